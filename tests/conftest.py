"""Test-session set-up shared by every file.

Triton's CPU interpreter: the kernel tests (tests/test_kernels_*.py) run the Triton
programs on CPU tensors, which needs TRITON_INTERPRET=1 before anything imports
triton. It is set here, for the whole session, on every machine alike (a GPU
machine runs the same CPU tests; the GPU checks are `benchmarks/gpu_suite.py`).

`float64`: a test that takes this fixture runs with torch's default dtype float64
and leaves the default as it found it (a file of float64 tests makes it autouse).
A spawned worker does the same with `pipekit.testing.in_float64`.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def float64():
    import torch  # (here, not at the top: nothing may import triton before the line above)

    from pipekit.precision import default_dtype

    with default_dtype(torch.float64):
        yield
