"""Triton kernels and their launchers.

One file per op (``csrc_triton/<op>.py``): private ``@triton.jit`` kernels and a launcher that
reshapes, allocates, picks the grid and launches. The autograd Functions and the public API are
in ``grpo_fast.ops``. Importing this package does not import triton; each op module does.
"""
