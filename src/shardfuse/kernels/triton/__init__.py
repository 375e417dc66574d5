"""Triton support shared by every op with Triton kernels (NVIDIA GPUs).

- `launch`: launchers (jax-triton on a GPU, the interpreter on CPU) and the
  checks a GPU launch needs.
- `interpreter`: the Triton interpreter worker process.
- `compile_stats`: compiling kernels for sm_80 / sm_90 without a GPU, registers,
  spills and shared memory (`ResourceUsage`), each GPU's `shared_memory_limit`,
  and `fit_num_stages` (the deepest software pipeline that fits it).

None of these import triton or jax_triton at import time.
"""
