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

from shardfuse.kernels.attention import triton_compile, triton_configs  # noqa: E402


def _check(kernel, arch, head_dim, dtype, variant):
    stats = triton_compile.compile_kernel(
        kernel, arch=arch, head_dim=head_dim, dtype=dtype, variant=variant
    )
    assert stats.spill_stores == 0 and stats.spill_loads == 0, stats
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
