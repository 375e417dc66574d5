"""`sf.generate` and its decode steps on Explicit and Auto meshes, against one device.

The same parameters on a one-device mesh are the oracle: greedy tokens equal, the
prefill and step logits within float32 reduction order. On each mesh the parameters are
laid out as the model lays them out there (ZeRO-3, pipelined stacks, a sequence axis),
the logits and the cache come back in the documented decode layout (batch over the batch
axes, kv heads over `model`), and a step given a cache the caller laid out otherwise
(replicated, or split over its length), eagerly or under the caller's jit, gives the same
logits: an Explicit mesh's shard_map used to refuse such a cache. `generate` under the
caller's jit gives the same tokens (it used to read the traced parameters' shardings).
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.models import generation

SPEC = sf.models.ModelSpec("tiny", hidden=32, heads=4, kv_heads=2, head_dim=8, ffn_hidden=64,
                           num_layers=2, vocab_size=64)  # fmt: skip
BATCH, PROMPT, NEW = 4, 5, 6
CACHE = PROMPT + NEW + 1  # 12: divisible by the axes a caller splits it over
# mesh shape, axis names, model options, the decode layout's batch axes
MESHES = {
    "data2_model4": ((2, 4), ("data", "model"), {}, ("data",)),
    "fsdp4_model2_zero3": ((4, 2), ("fsdp", "model"), dict(zero=3), ("fsdp",)),
    "pipeline2_data2_model2": (
        (2, 2, 2),
        ("pipeline", "data", "model"),
        dict(pipelined=True),
        ("data",),
    ),  # fmt: skip
    "data2_sequence2_model2": ((2, 2, 2), ("data", "sequence", "model"), {}, ("data",)),
}
QUICK = [("data2_model4", AxisType.Explicit)]  # Auto data2_model4: test_hf.py's greedy test


def _model(shape, names, axis_type, **options):
    devices = jax.devices()[: int(np.prod(shape))]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names), devices=devices)
    model = sf.models.Transformer(SPEC, mesh=mesh, rngs=nnx.Rngs(0), **options)
    # the same parameters on every mesh, larger than the initialiser's: clear argmax margins
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = jax.random.key(zlib.crc32(".".join(map(str, path)).encode()))
        full = np.asarray(jax.random.normal(key, value.shape, value.dtype)) * 0.3
        value.set_value(jax.device_put(full, value[...].sharding))
    return model, mesh


@pytest.fixture(scope="module")
def oracle():
    """Tokens, prefill logits and first step logits on one device."""
    model, _ = _model((1,), ("data",), AxisType.Explicit)
    prompt = np.random.default_rng(0).integers(0, SPEC.vocab_size, (BATCH, PROMPT))
    tokens = np.asarray(sf.generate(model, prompt, NEW, cache_size=CACHE))
    program = generation.DecodeProgram(model, batch=BATCH, cache_size=CACHE)
    prefill, cache = program.prefill(prompt)
    step, _ = program.step(tokens[:, :1], cache, PROMPT)
    return prompt, tokens, np.asarray(prefill), np.asarray(step)


CASES = [(m, a) for m in MESHES for a in (AxisType.Explicit, AxisType.Auto)]


@pytest.mark.parametrize(
    "mesh_name, axis_type",
    [pytest.param(m, a, marks=() if (m, a) in QUICK else pytest.mark.slow) for m, a in CASES],
    ids=[f"{m}-{a.name}" for m, a in CASES],
)
def test_generation_on_a_mesh_equals_one_device(oracle, mesh_name, axis_type):
    prompt, want_tokens, want_prefill, want_step = oracle
    shape, names, options, batch_axes = MESHES[mesh_name]
    model, mesh = _model(shape, names, axis_type, **options)
    tokens = sf.generate(model, prompt, NEW, cache_size=CACHE)
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
    tokens_sharding = NamedSharding(mesh, P(batch_axes, None))
    assert tokens.sharding.is_equivalent_to(tokens_sharding, 2), tokens.sharding
    # under the caller's jit (it read the traced parameters' shardings, and the eos check)
    eos = int(want_tokens[0, 2])
    jitted = jax.jit(lambda t: sf.generate(model, t, NEW, cache_size=CACHE, eos_id=eos))(prompt)
    want_eos = np.where(np.cumsum(want_tokens == eos, axis=1) > 0, eos, want_tokens)
    np.testing.assert_array_equal(np.asarray(jitted), want_eos)
    assert jitted.sharding.is_equivalent_to(tokens_sharding, 2), jitted.sharding

    program = generation.DecodeProgram(model, batch=BATCH, cache_size=CACHE)
    logits, cache = program.prefill(prompt)
    np.testing.assert_allclose(np.asarray(logits), want_prefill, atol=1e-5, rtol=1e-5)
    logits_sharding = NamedSharding(mesh, P(batch_axes, None))
    cache_sharding = NamedSharding(mesh, P(None, batch_axes, None, "model", None))
    assert logits.sharding.is_equivalent_to(logits_sharding, 2), logits.sharding
    for c in cache:
        assert c.sharding.is_equivalent_to(cache_sharding, 5), c.sharding

    new = jnp.asarray(want_tokens[:, :1], jnp.int32)
    own, _ = program.step(new, cache, PROMPT)
    np.testing.assert_allclose(np.asarray(own), want_step, atol=1e-5, rtol=1e-5)
    replicated = tuple(jax.device_put(c, NamedSharding(mesh, P())) for c in cache)
    by_length = tuple(
        jax.device_put(c, NamedSharding(mesh, P(None, None, names[0]))) for c in cache
    )
    for how, step, user_cache in (
        ("eager, replicated", program.step, replicated),
        ("jit, replicated", jax.jit(program.step), replicated),
        ("jit, split over S", jax.jit(program.step), by_length),
    ):
        got, new_cache = step(new, user_cache, PROMPT)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(own), err_msg=how)
        assert got.sharding.is_equivalent_to(logits_sharding, 2), (how, got.sharding)
        for c in new_cache:
            assert c.sharding.is_equivalent_to(cache_sharding, 5), (how, c.sharding)
