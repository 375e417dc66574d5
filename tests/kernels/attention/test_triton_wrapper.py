"""The Triton attention wrapper without running a kernel: dispatch, lazy imports, block tables."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels.attention import base, masks, triton_configs, triton_gpu
from shardfuse.kernels.triton.launch import InterpretLauncher

ON_GPU = jax.default_backend() in ("gpu", "cuda")


def test_import_does_not_import_triton():
    code = (
        "import sys, shardfuse\n"
        "import shardfuse.kernels.attention.triton_gpu\n"
        "import shardfuse.kernels.triton.launch\n"
        "bad = [m for m in ('triton', 'jax_triton', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU fallback")
def test_triton_raises_not_implemented_on_cpu_and_info_says_why():
    q = k = v = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(NotImplementedError, match="NVIDIA GPU"):
        sf.flash_attention(q, k, v, implementation="triton")
    usable, why = sf.info(print_report=False)["implementations"]["attention"]["triton"]
    assert not usable and "NVIDIA GPU" in why
    # The default never picks triton on CPU, and still answers.
    assert sf.flash_attention(q, k, v).shape == q.shape


def _config(**kwargs):
    q = jnp.zeros((1, 16, 2, 16))
    options = dict(
        causal=False,
        q_positions=None,
        kv_positions=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        window=None,
        logit_softcap=None,
        scale=None,
    )
    options.update(kwargs)
    return base.validate(q, q, q, **options)


@pytest.mark.parametrize("block_sizes", [base.BlockSizes(24, 16), base.BlockSizes(16, 8)])
def test_unsupported_block_sizes_raise_not_implemented(block_sizes):
    q = jnp.zeros((1, 16, 2, 16))
    config = _config(block_sizes=block_sizes)
    pos = jnp.arange(16, dtype=jnp.int32)
    with pytest.raises(NotImplementedError, match="powers of two >= 16"):
        triton_gpu.flash_attention(
            config, q, q, q, pos, pos, None, None, launcher=InterpretLauncher()
        )


def test_head_dim_above_256_raises_not_implemented():
    q = jnp.zeros((1, 4, 1, 320))
    config = base.validate(
        q,
        q,
        q,
        causal=False,
        q_positions=None,
        kv_positions=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        window=None,
        logit_softcap=None,
        scale=None,
    )
    pos = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(NotImplementedError, match="head dims up to 256"):
        triton_gpu.flash_attention(
            config, q, q, q, pos, pos, None, None, launcher=InterpretLauncher()
        )


def test_default_configs_cover_every_generation_and_head_dim():
    for capability in (80, 86, 89, 90, 100):
        for head_dim in (8, 16, 24, 32, 64, 72, 96, 128, 192, 256):
            for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
                if dtype == jnp.float32 and head_dim > triton_configs.MAX_FLOAT32_HEAD_DIM:
                    with pytest.raises(NotImplementedError, match="float32 inputs up to head dim"):
                        triton_configs.default_configs(capability, head_dim, dtype)
                    continue
                configs = triton_configs.default_configs(capability, head_dim, dtype)
                for kernel in triton_configs.KERNELS:
                    c = configs.get(kernel)
                    assert c.block_m >= 16 and c.block_m & (c.block_m - 1) == 0
                    assert c.block_n >= 16 and c.block_n & (c.block_n - 1) == 0
    with pytest.raises(NotImplementedError, match="compute capability"):
        triton_configs.default_configs(75, 64, jnp.float16)


@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True, window=(60, None)),
        dict(window=(20, 3), segments=True),
        dict(causal=True, shuffled=True),
    ],
    ids=str,
)
def test_block_ranges_cover_every_visible_block_and_only_full_ones_unmasked(options):
    """`masks.visit_ranges` vs the element mask: no visible block skipped, no partial unmasked."""
    B, T, S, block_m, block_n = 2, 70, 93, 16, 32
    key = jax.random.key(0)
    q_pos = jnp.arange(T, dtype=jnp.int32) + S - T
    kv_pos = jnp.arange(S, dtype=jnp.int32)
    shuffled = options.pop("shuffled", False)
    if shuffled:
        q_pos = jax.random.permutation(key, q_pos)
    q_seg = kv_seg = None
    if options.pop("segments", False):
        q_seg = jnp.sort(jax.random.randint(key, (B, T), 0, 3), axis=1)
        kv_seg = jnp.sort(jax.random.randint(jax.random.key(1), (B, S), 0, 3), axis=1)
    config = base.AttentionConfig(
        causal=options.get("causal", False),
        window=options.get("window"),
        logit_softcap=None,
        scale=1.0,
    )
    visible, full = masks.block_table(config, q_pos, kv_pos, q_seg, kv_seg, block_m, block_n)
    ranges = np.asarray(masks.visit_ranges(visible, full, B))  # [B, nq, 4]
    mask = np.broadcast_to(masks.visibility_mask(config, q_pos, kv_pos, q_seg, kv_seg), (B, T, S))
    nq, nk = -(-T // block_m), -(-S // block_n)
    assert ranges.shape == (B, nq, 4)
    if config.window == (60, None):  # blocks well inside the band run without a mask
        assert (ranges[..., 2] > ranges[..., 1]).any()
    for b in range(B):
        for i in range(nq):
            lo, full_lo, full_hi, hi = ranges[b, i]
            assert lo <= full_lo <= full_hi <= hi
            visible_blocks = 0
            for j in range(nk):
                tile = np.zeros((block_m, block_n), bool)  # padding counts as not visible
                part = mask[b, i * block_m : (i + 1) * block_m, j * block_n : (j + 1) * block_n]
                tile[: part.shape[0], : part.shape[1]] = part
                if tile.any():
                    assert lo <= j < hi, (b, i, j, ranges[b, i])
                    visible_blocks += 1
                if full_lo <= j < full_hi:
                    assert tile.all(), (b, i, j, ranges[b, i])
            if not shuffled:  # monotone positions: exactly the visible blocks are visited
                assert hi - lo == visible_blocks, (b, i, ranges[b, i], visible_blocks)
