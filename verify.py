#!/usr/bin/env python3
"""Import-time smoke test of an applied (or pristine) vLLM. See README.md or `verify.py --help`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dsa_installer.bootstrap import main_without_dependencies, missing_dependencies  # noqa: E402

if __name__ == "__main__":
    missing = missing_dependencies()
    if missing:
        main_without_dependencies(sys.argv[1:], missing, "verify.py")
    else:
        from dsa_installer.verify import main

        main()
