#!/usr/bin/env python3
"""Import-time smoke test of an applied (or pristine) vLLM. See README.md or `verify.py --help`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dsa_installer.verify import main  # noqa: E402

if __name__ == "__main__":
    main()
