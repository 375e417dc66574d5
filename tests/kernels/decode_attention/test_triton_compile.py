"""The Triton decode-attention kernel compiles for sm_80 and sm_90 with 0 spills, no GPU needed.

`triton.compile` for `GPUTarget("cuda", arch, 32)`; registers and spills from the ptxas
bundled with triton, shared memory from the compiled metadata. The default run compiles
head dim 128 bfloat16 with window and softcap on, for one query per kv head group (G = 4,
T = 1: a decode step) and for the most rows a program holds (G * T = 128); `-m slow`
compiles every tuned config over head dims, dtypes, row counts and both variants.
"""

import pytest

pytest.importorskip("triton", reason="needs triton (pip install triton)")

from shardfuse.kernels.decode_attention import triton_compile, triton_gpu  # noqa: E402


def _check(arch, head_dim, dtype, variant, G, T):
    stats = triton_compile.compile_kernel(
        arch=arch, head_dim=head_dim, dtype=dtype, variant=variant,
        num_heads=8 * G, num_kv_heads=8, num_queries=T,
    )  # fmt: skip
    assert stats.spill_stores == 0 and stats.spill_loads == 0, stats
    assert stats.shared_memory <= stats.shared_memory_limit, stats
    assert 0 < stats.registers <= 255, stats


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("G, T", [(4, 1), (8, 16)])
def test_default_configs_compile_without_spills(arch, G, T):
    _check(arch, 128, "bfloat16", "all", G, T)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, head_dim, dtype, variant, G, T",
    [
        (arch, head_dim, dtype, variant, G, T)
        for arch in (80, 90)
        for dtype, head_dims in (("bfloat16", (16, 64, 128, 256)), ("float32", (16, 32, 64)))
        for head_dim in head_dims
        for variant in ("causal", "all")
        for G, T in ((1, 1), (8, 2), (8, 4), (4, 16), (8, 16))
        if G * T <= (triton_gpu.MAX_ROWS if head_dim <= 128 else triton_gpu.MAX_ROWS_WIDE)
    ],
)
def test_every_config_compiles_without_spills(arch, head_dim, dtype, variant, G, T):
    _check(arch, head_dim, dtype, variant, G, T)
