"""Stand-alone benchmark and compile-statistics programs.

Run each as `python -m shardfuse.bench.tools.NAME`:


- `peers`: the default CPU attention against tokamax and `jax.nn`, with a matmul roofline;
- `grouped_matmul_peers`: the default grouped (MoE) matmul against `jax.lax.ragged_dot`,
  tokamax, the one-hot dense formulation and a dense matmul of the same FLOPs;
- `attention_cpu_timing`: CPU time of attention, xla vs reference vs `jax.nn`;
- `attention_memory`: compiled temp memory of attention forward+backward as S grows;
- `gpu_attention`: shardfuse's default and GPU attention backends against cuDNN (jax.nn),
  jax's attention_mgpu and tokamax on an NVIDIA GPU; writes the GPU dispatch table;
- `triton_compile_stats`: registers, spills and shared memory of the Triton kernels for
  sm_80/sm_90, compiled without a GPU (writes `bench/results/triton_compile_stats.md`).
"""
