"""Generated decode-attention configurations against an independent float64 NumPy oracle.

Hypothesis draws configurations from the whole option space `sf.decode_attention`
accepts (batch, queries T, cache length S, GQA ratio and MQA, head dim, per-row lengths
from 0 to S, window, softcap, scale, block_kv including sizes that do not divide S,
float32) and compares the reference and xla implementations with per-(row, head, query)
loops in NumPy float64 (`tests/kernels/attention/common.naive_attention_numpy`, on a mask
built from the definition, not from the library's masks). A small fixed-seed budget runs
by default, a large one under `-m slow`; `test_generator_catches_planted_bugs` shows that
the same draws fail when the query positions are off by one or a chunk is dropped from
the lse merge.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels.decode_attention import base
from shardfuse.testing import assert_close
from tests.differential.budget import assert_catches, budget_params
from tests.differential.budget import run as run_budget
from tests.kernels.attention.common import naive_attention_numpy


@st.composite
def configs(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 5))
    S = draw(st.integers(1, 80))
    K = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([4, 8, 16]))
    lengths = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
    left = draw(st.one_of(st.none(), st.integers(0, 40)))
    window = None if left is None else (left, draw(st.sampled_from([0, None, 3])))
    return dict(
        shape=(B, T, S, G * K, K, D),
        lengths=tuple(lengths),
        window=window,
        logit_softcap=draw(st.sampled_from([None, 2.0])),
        scale=draw(st.sampled_from([None, 0.3])),
        block_kv=draw(st.one_of(st.none(), st.integers(1, 40))),
        implementation=draw(st.sampled_from(["reference", "xla"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _oracle(q, k, v, lengths, window, softcap, scale):
    B, T, H, D = q.shape
    S = k.shape[1]
    lengths = np.asarray(lengths)[:, None, None]
    q_pos = lengths - T + np.arange(T)[None, :, None]
    kv = np.arange(S)[None, None, :]
    mask = (kv < lengths) & (kv <= q_pos)
    if window is not None and window[0] is not None:
        mask &= q_pos - kv <= window[0]
    return naive_attention_numpy(q, k, v, mask, D**-0.5 if scale is None else scale, softcap)


def _check(config):
    B, T, S, H, K, D = config["shape"]
    keys = jax.random.split(jax.random.key(config["seed"]), 3)
    q = jax.random.normal(keys[0], (B, T, H, D))
    k = jax.random.normal(keys[1], (B, S, K, D))
    v = jax.random.normal(keys[2], (B, S, K, D))
    options = dict(
        window=config["window"], logit_softcap=config["logit_softcap"], scale=config["scale"]
    )
    decode = jax.jit(
        lambda q, k, v, lengths: sf.decode_attention(
            q, k, v, lengths, return_lse=True, block_kv=config["block_kv"],
            implementation=config["implementation"], **options,
        )
    )  # fmt: skip
    out, lse = decode(q, k, v, jnp.asarray(config["lengths"], jnp.int32))
    expected_out, expected_lse = _oracle(
        q, k, v, config["lengths"], config["window"], config["logit_softcap"], config["scale"]
    )
    label = f"{config}"
    assert_close(out, expected_out, name=f"out {label}")
    assert_close(lse, expected_lse, name=f"lse {label}")


# Budgets: 6 draws in the default suite, 40 under -m slow (80 before: the first 40 of the
# fixed draws already hold every batch size, T, K, group size, head dim, window kind,
# softcap, scale, block_kv kind and implementation, and lengths 0, S and < T)
@pytest.mark.parametrize("max_examples", budget_params(6, 40))
def test_matches_numpy_oracle(max_examples):
    run_budget(_check, configs(), max_examples)


def _positions_off_by_one(monkeypatch):
    original = base.query_positions
    monkeypatch.setattr(base, "query_positions", lambda lengths, T: original(lengths, T) + 1)


def _merge_drops_last_chunk(monkeypatch):
    original = base.merge_partials

    def merge(out, lse, dtype):
        if out.shape[1] > 1:
            out, lse = out[:, :-1], lse[:, :-1]
        return original(out, lse, dtype)

    monkeypatch.setattr(base, "merge_partials", merge)


@pytest.mark.parametrize("plant", [_positions_off_by_one, _merge_drops_last_chunk])
def test_generator_catches_planted_bugs(plant, monkeypatch):
    def check_xla(config):
        _check({**config, "implementation": "xla"})

    assert_catches(plant, check_xla, configs(), 10, monkeypatch)
