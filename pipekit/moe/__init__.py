"""Mixture-of-Experts: router, token dispatch (dropless / capacity, expert parallel), experts
and the MoE block. Empty so far: it arrives with its own issue (see ../shared/DESIGN.md)."""
