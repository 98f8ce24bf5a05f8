#!/usr/bin/env python3
"""Apply / roll back the dsa-overlay patch set on an installed vLLM. See README.md or `apply.py --help`.

On a Python without the tool's dependencies (click, unidiff) only `apply.py bootstrap` runs (standard
library only; it installs them into the venv it makes); every other command says so in one line."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dsa_installer.bootstrap import main_without_dependencies, missing_dependencies  # noqa: E402

if __name__ == "__main__":
    missing = missing_dependencies()
    if missing:
        main_without_dependencies(sys.argv[1:], missing)
    else:
        from dsa_installer.cli import main

        main()
