"""implementation=None on NVIDIA GPUs: the dispatch table's rule (gpu_dispatch.py)."""

import doctest
import json

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse import hardware
from shardfuse.kernels.attention import base, cudnn, gpu_dispatch, masks

CAUSAL = base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=0.1)
FULL = base.AttentionConfig(causal=False, window=None, logit_softcap=None, scale=0.1)


def _row(mask, seq_len, head_dim, order, generation="sm90", dtype="bfloat16"):
    return dict(generation=generation, head_dim=head_dim, dtype=dtype, mask=mask,
                seq_len=seq_len, order=order)  # fmt: skip


TABLE = {
    "rows": [
        _row("causal", 1024, 128, ["cudnn", "mosaic_gpu"]),
        _row("causal", 16384, 128, ["mosaic_gpu", "cudnn"]),
        _row("full", 4096, 64, ["triton", "mosaic_gpu"]),
        _row("segments", 4096, 128, ["mosaic_gpu", "triton"]),
        _row("full", 4096, 64, ["triton"], generation="sm80"),
    ],
    "fallback": {"sm90": ["mosaic_gpu", "triton", "xla"], "sm80": ["triton", "xla"]},
}


def _shapes(T, S, D, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((1, T, 8, D), dtype), jax.ShapeDtypeStruct((1, S, 8, D), dtype)


def _preference(config, T, S, D, capability=90, segments=False, dtype=jnp.bfloat16):
    q, k = _shapes(T, S, D, dtype)
    return gpu_dispatch.preference(config, q, k, object() if segments else None, capability, TABLE)


def test_nearest_length_on_a_log_scale_then_the_fallback():
    assert _preference(CAUSAL, 2048, 2048, 128)[:2] == ("cudnn", "mosaic_gpu")  # nearer 1k
    assert _preference(CAUSAL, 8192, 8192, 128)[:2] == ("mosaic_gpu", "cudnn")  # nearer 16k
    assert _preference(CAUSAL, 8192, 8192, 128)[-2:] == ("triton", "xla")


def test_head_dim_rounds_up_to_a_measured_one_and_mask_kind_is_the_most_specific():
    assert _preference(FULL, 4096, 4096, 48)[0] == "triton"  # 48 -> the 64 row
    assert _preference(FULL, 4096, 4096, 96)[0] == "mosaic_gpu"  # no full row >= 96: fallback
    assert _preference(CAUSAL, 4096, 4096, 128, segments=True)[:2] == ("mosaic_gpu", "triton")


def test_generation_dtype_and_unmeasured_cases_take_the_fallback():
    assert _preference(FULL, 4096, 4096, 64, capability=80) == ("triton", "xla")
    assert _preference(FULL, 4096, 4096, 64, dtype=jnp.float16)[0] == "mosaic_gpu"
    assert gpu_dispatch.preference(FULL, *_shapes(64, 64, 64), None, 90, {"rows": []})[-1] == "xla"


def test_every_name_is_an_attention_backend_and_the_shipped_table_is_well_formed():
    names = set(sf.kernels.registry.get("attention").names)
    table = gpu_dispatch.load_table()
    for row in table["rows"]:
        assert set(row) >= {"generation", "head_dim", "dtype", "mask", "seq_len", "order"}
        assert row["mask"] in ("full", "causal", "segments", "window")
        assert set(row["order"]) <= names, row
    for order in table.get("fallback", {}).values():
        assert set(order) <= names and order[-1] == "xla"
    if gpu_dispatch.TABLE_FILE.exists():
        json.loads(gpu_dispatch.TABLE_FILE.read_text())


def test_run_tries_the_given_order_for_implementation_none():
    op = sf.kernels.registry.get("attention")
    tried = []

    def call(name):
        tried.append(name)
        if name != "triton":
            raise NotImplementedError(name)
        return name

    assert op.run(None, call, order=("cudnn", "mosaic_gpu", "triton")) == "triton"
    assert tried == ["cudnn", "mosaic_gpu", "triton"]
    with pytest.raises(NotImplementedError, match="cudnn"):
        op.run("cudnn", call, order=("triton",))  # a name runs alone, order or not


def test_info_reports_the_rule_where_it_applies():
    report = sf.info(print_report=False)
    if jax.default_backend() in ("gpu", "cuda"):
        assert "measurement" in report["rules"]["attention"]
    else:
        assert "attention" not in report["rules"]
    assert "measured cases" in gpu_dispatch.describe(
        "gpu" if hardware.compute_capability() else "cpu"
    )


def test_docstring_examples():
    for module in (gpu_dispatch, cudnn, masks, hardware):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, module.__name__
