#!/usr/bin/env python3
"""Apply / roll back the dsa-overlay patch set on an installed vLLM. See README.md or `apply.py --help`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dsa_installer.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
