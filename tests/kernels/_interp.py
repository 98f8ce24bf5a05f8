"""Re-export: the Triton-interpreter loader lives in tools/triton_interp.py (shared with bench/).

Importing it sets TRITON_INTERPRET=1, as before."""

from tools.triton_interp import load_interpreted, numpy24_fix  # noqa: F401
