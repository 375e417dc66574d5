"""The capped dense dispatch (`moe_capped.capped_expert_parallel`, the CPU's expert-parallel path):
`expert_dispatch.dense_chunk` rows a destination, and the full-size dispatch where a
destination would get more (dropless either way).

Both branches are reached by construction, not by chance: the inputs route every device's
tokens evenly over the destinations (2 rows to each, the chunk 4 of 8) or all of them to
device 0 (8 rows, past the chunk). Outputs, statistics and every gradient equal the
one-device oracle in both, under Explicit and Auto meshes, eagerly and under `jit`; a
planted mutant that never falls back fails the oracle. (What the compiled layer moves:
tests/layers/test_moe_structure.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse.collectives import expert_dispatch
from shardfuse.layers import _sharding
from shardfuse.layers import moe as moe_lib
from tests.layers.moe_cases import Case, build, check_case

F, E, K, EP, TOKENS = 8, 8, 2, 4, 4  # 4 tokens a device: A = 8 rows, chunk 4


def _case(axis_type="explicit", mode="eager"):
    return Case(mesh=(("data", 2), ("expert", EP)), axis_type=axis_type, mode=mode,
                num_experts=E, top_k=K, seq=TOKENS)  # fmt: skip


def _routed(case, routing):
    """The layer, with a router that sends a token whose features are one-hot at f (< 4) to
    experts 2f and 2f + 1 (device f), and inputs routed as `routing` says."""
    moe = build(case, features=F, expert_hidden=8)
    router = np.zeros((F, E), np.float32)
    for f in range(EP):
        router[f, 2 * f : 2 * f + 2] = 4.0
    moe.router[...] = jax.device_put(router, moe.router[...].sharding)
    batch = 2 * EP  # one sequence of TOKENS a device
    noise = 0.1 * np.random.default_rng(0).standard_normal((batch, TOKENS, F))
    hot = np.zeros((batch, TOKENS, F), np.float32)
    for t in range(TOKENS):  # "balanced": token t of every device to device t
        hot[:, t, t if routing == "balanced" else 0] = 2.0
    return moe, jnp.asarray(hot + noise, jnp.float32)


def test_the_chunk_is_below_the_rows():
    A = TOKENS * K
    assert expert_dispatch.dense_chunk(A, EP) == 4 < A  # so that the capped path runs


@pytest.mark.parametrize("routing", ["balanced", "overflow"])
@pytest.mark.parametrize("axis_type, mode", [("explicit", "eager"), ("auto", "jit")])
def test_capped_dispatch_equals_the_oracle(routing, axis_type, mode):
    case = _case(axis_type, mode)
    moe, x = _routed(case, routing)
    stats = check_case(case, moe=moe, x=x)
    per_device = np.asarray(stats["tokens_per_expert"]).reshape(EP, 2).sum(1)
    if routing == "balanced":  # each device's rows: 2 to every destination
        assert per_device.tolist() == [2 * 2 * EP] * EP
    else:  # every row to device 0: 8 of each device's, past the chunk of 4
        assert per_device.tolist() == [2 * EP * TOKENS * K] + [0] * (EP - 1)


def test_a_capped_dispatch_that_never_falls_back_fails_the_oracle(monkeypatch):
    original = moe_lib.capped_expert_parallel

    def never(rows, sorted_e, gate_up, down, overflow, *args):
        return original(rows, sorted_e, gate_up, down, jnp.zeros_like(overflow), *args)

    case = _case()
    moe, x = _routed(case, "overflow")
    _sharding._compiled.clear_cache()
    monkeypatch.setattr(moe_lib, "capped_expert_parallel", never)
    try:
        with pytest.raises(AssertionError):
            check_case(case, moe=moe, x=x)
    finally:
        monkeypatch.undo()
        _sharding._compiled.clear_cache()
