"""Every Triton attention kernel compiles for sm_80 and sm_90 at its default config, no GPU needed.

`triton.compile` for `GPUTarget("cuda", arch, 32)`; registers and spills from
the ptxas bundled with triton, shared memory from the compiled metadata. The
default run compiles the head dim 128 bfloat16 kernels with every mask option
on (the most registers); `-m slow` compiles the whole table that
`python -m shardfuse.bench.tools.triton_compile_stats` writes to
bench/results/triton_compile_stats.md.
"""

import pytest

pytest.importorskip("triton", reason="needs triton (pip install triton)")

import shardfuse as sf  # noqa: E402
from shardfuse.kernels.attention import triton_compile, triton_configs  # noqa: E402


def _check(kernel, arch, head_dim, dtype, variant):
    stats = triton_compile.compile_kernel(
        kernel, arch=arch, head_dim=head_dim, dtype=dtype, variant=variant
    )
    # No spills, except a few in GPU-timed entries that measured faster (GPU_TIMED says).
    assert stats.acceptable, stats
    assert stats.shared_memory <= stats.shared_memory_limit, stats
    assert 0 < stats.registers <= 255, stats


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kernel", triton_configs.KERNELS)
def test_default_configs_compile_without_spills(kernel, arch):
    _check(kernel, arch, 128, "bfloat16", "all")


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, head_dim, dtype, variant",
    [
        (arch, head_dim, dtype, variant)
        for arch in (80, 90)
        for dtype, head_dims in (("bfloat16", (16, 32, 64, 128, 256)), ("float32", (16, 32, 64)))
        for head_dim in head_dims
        for variant in ("causal", "all")
        if (head_dim, dtype, variant) != (128, "bfloat16", "all")  # the default run has it
    ],
)
def test_every_default_config_compiles_without_spills(arch, head_dim, dtype, variant):
    for kernel in triton_configs.KERNELS:
        _check(kernel, arch, head_dim, dtype, variant)


@pytest.mark.slow  # compiles five kernels (about 30 s)
def test_launch_lowers_pipeline_stages_to_fit_shared_memory(monkeypatch):
    """User tiles of 128 x 128 at head dim 128: the tuned 3 dQ stages ask for 256 KiB on sm_90.

    Seen on an H200 (`Shared memory requested (262144 b) exceeds device resources
    (232448 b)`). The jax-triton launcher compiles each kernel first and lowers
    `num_stages` until it fits; a tile that does not fit in one stage (here on
    sm_86's 99 KiB) is refused with NotImplementedError, so dispatch falls back.
    The kernels, inputs and constexprs are those the real backward launches,
    with TRITON_CACHE_DIR empty as importing jax_triton leaves it (on the H200
    that made `triton.compile` fail: "Could not create or locate cache dir").
    """
    import dataclasses

    import jax.numpy as jnp

    from shardfuse.kernels.attention import base, triton_gpu
    from shardfuse.kernels.triton import compile_stats, launch

    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    fitted = {}

    @dataclasses.dataclass(frozen=True)
    class Fitting(launch.JaxTritonLauncher):
        def __call__(self, kernel_name, inputs, out_shapes, grid, config, constexprs):
            kernel = getattr(launch.kernel_module(self.kernels_module), kernel_name)
            fitted[kernel_name] = launch._fit_shared_memory(
                kernel, inputs, out_shapes, config, constexprs, self
            )
            return [jnp.zeros(shape.shape, shape.dtype) for shape in out_shapes]

    T, H, K, D = 256, 4, 2, 128
    q = jnp.zeros((1, T, H, D), jnp.bfloat16)
    k = v = jnp.zeros((1, T, K, D), jnp.bfloat16)
    config = base.validate(q, k, v, causal=True, block_sizes=sf.BlockSizes(128, 128))
    pos = jnp.arange(T, dtype=jnp.int32)
    lse = jnp.zeros((1, H, T), jnp.float32)

    def backward(capability):
        launcher = Fitting(capability)
        return triton_gpu.backward(config, q, k, v, pos, pos, None, None, q, lse, q, lse,
                                   launcher=launcher)  # fmt: skip

    backward(90)
    assert compile_stats.shared_memory_limit(90) == 232448
    assert fitted["attention_backward_dq_kernel"] == triton_configs.AttentionKernelConfig(
        128, 128, 8, 2
    )
    with pytest.raises(NotImplementedError, match="shared memory.*compute capability 8.6"):
        backward(86)
