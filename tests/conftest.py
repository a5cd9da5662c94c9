"""Test-session set-up shared by every file.

Triton's CPU interpreter: the kernel tests (tests/test_kernels_*.py) run the Triton
programs on CPU tensors, which needs TRITON_INTERPRET=1 before anything imports
triton. It is set here, for the whole session, on every machine alike (a GPU
machine runs the same CPU tests; the GPU checks are `benchmarks/gpu_suite.py`).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
