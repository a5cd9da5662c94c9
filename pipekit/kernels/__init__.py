"""Triton kernels, each beside its PyTorch reference, dispatched by device. Empty so far: they
arrive with their own issue (see ../shared/DESIGN.md)."""
