"""`sf.generate` against recomputing the whole sequence with the model's own forward.

The Hugging Face tests (test_hf.py) check Llama, Mistral and Qwen2 checkpoints
against `transformers`; these check the other options of the one model (GPT-style:
GELU, LayerNorm, biases, learned positions, tied embeddings; a sliding window) with
no torch, on two meshes: greedy decoding with the KV cache must pick, at every step,
the argmax of the full forward pass over the prompt and the tokens so far. And the
bounds: positions beyond the cache or a learned position table are refused, not
computed from clamped or NaN rows.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardfuse as sf
from shardfuse.models import generation

SPECS = {
    "gpt": sf.models.ModelSpec(
        "gpt",
        hidden=32,
        heads=4,
        kv_heads=4,
        head_dim=8,
        ffn_hidden=64,
        num_layers=2,
        vocab_size=64,
        activation="gelu",
        norm="layernorm",
        positions="learned",
        max_positions=16,
        use_bias=True,
        tied_embeddings=True,
    ),  # fmt: skip
    "window": sf.models.ModelSpec(
        "window",
        hidden=32,
        heads=4,
        kv_heads=2,
        head_dim=8,
        ffn_hidden=64,
        num_layers=2,
        vocab_size=64,
        window=3,
    ),  # fmt: skip
}
MESHES = {"model2": ((2,), ("model",)), "data2_model2": ((2, 2), ("data", "model"))}


def _model(name, mesh_name):
    shape, names = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])
    # the oracle's full forward runs at any length: no sequence split over model
    model = sf.models.Transformer(SPECS[name], mesh=mesh, sequence_parallel=False, rngs=nnx.Rngs(0))
    # larger weights than the initialiser's: clear argmax margins
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = jax.random.fold_in(jax.random.key(1), zlib.crc32(str(path).encode()))
        noise = 0.3 * jax.random.normal(key, value.shape, value.dtype)
        value.set_value(jax.device_put(value[...] + noise, value[...].sharding))
    return model, mesh


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_greedy_generation_equals_recomputing_the_sequence(name, mesh_name):
    model, mesh = _model(name, mesh_name)
    prompt = np.random.default_rng(0).integers(0, 64, (2, 5)).astype(np.int32)
    new = 16 - 5 + 1 if name == "gpt" else 8  # gpt: up to the last row of its table
    got = np.asarray(sf.generate(model, prompt, new))
    # The full forward is causal, so one call on prompt + generated tokens gives the logits
    # that recomputing the growing sequence would give at every step (one program instead
    # of one per length): greedy decoding is right iff each token is the argmax there.
    seq = np.concatenate([prompt, got[:, :-1]], axis=1)
    with jax.set_mesh(mesh):
        logits = np.asarray(model(jnp.asarray(seq)))
    np.testing.assert_array_equal(got, logits[:, 4:].argmax(-1))


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float32])
def test_a_cache_in_another_dtype_decodes_the_full_forward(cache_dtype):
    """`cache_dtype` other than the parameters' (a bfloat16 cache for a float32 model): the
    decode steps read it back in the queries' dtype (it was a dtype error) and give the
    full forward's logits, within bfloat16 rounding of the cached keys and values."""
    model, mesh = _model("window", "model2")
    tokens = np.random.default_rng(1).integers(0, 64, (2, 9)).astype(np.int32)
    program = generation.DecodeProgram(model, batch=2, cache_size=9, cache_dtype=cache_dtype)
    logits, cache = program.prefill(tokens[:, :5])
    assert cache[0].dtype == cache_dtype
    steps = [logits]
    for i in range(5, 9):
        logits, cache = program.step(tokens[:, i : i + 1], cache, i)
        steps.append(logits)
    with jax.set_mesh(mesh):
        want = np.asarray(model(jnp.asarray(tokens)))[:, 4:]
    got = np.stack([np.asarray(step).reshape(2, -1) for step in steps], axis=1)
    tol = 0.02 if cache_dtype == jnp.bfloat16 else 1e-4  # measured: 2.9e-3 and 5e-7
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max())


def test_positions_beyond_the_cache_or_the_position_table_are_refused():
    model, _ = _model("gpt", "model2")
    prompt = np.zeros((1, 5), np.int32)
    with pytest.raises(ValueError, match="max_positions=16"):
        sf.generate(model, prompt, 13)  # reads position 16
    with pytest.raises(ValueError, match="max_positions=16"):
        sf.generate(model, np.zeros((1, 17), np.int32), 1)
    program = generation.DecodeProgram(model, batch=1, cache_size=8)
    _, cache = program.prefill(prompt)
    with pytest.raises(ValueError, match=r"positions 8\.\.8 do not fit cache_size=8"):
        program.step(np.zeros((1, 1), np.int32), cache, 8)
    with pytest.raises(ValueError, match="do not fit"):
        program.step(np.zeros((1, 1), np.int32), cache, -1)
    for bad in (dict(cache_size=0), dict(batch=0), dict(cache_size=4.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            generation.DecodeProgram(model, **{"batch": 1, "cache_size": 8, **bad})
    for bad_id in (64, -1):  # the embedding's NaN row decoded as token 0
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
            sf.generate(model, np.array([[1, 2, bad_id]], np.int32), 2)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        program.step(np.full((1, 1), 64, np.int32), cache, 5)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        program.prefill(jnp.full((1, 2), 70, jnp.int32))
    with pytest.raises(ValueError, match="cache_size=0"):
        sf.generate(model, prompt, 2, cache_size=0)  # was taken as "the default"
    big = generation.DecodeProgram(model, batch=1, cache_size=20)
    _, cache = big.prefill(prompt)
    with pytest.raises(ValueError, match="learned position table"):
        big.step(np.zeros((1, 1), np.int32), cache, 16)


BAD_SAMPLING = [
    (dict(top_k=0), "top_k=0"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p"),
]


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    """As transformers' TopKLogitsWarper: k is clamped to the vocabulary (was an XLA error)."""
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    keys = jax.random.split(jax.random.key(0), 64)

    def drawn(k):
        draws = jax.vmap(lambda key: generation.sample(logits, key, temperature=1.0, top_k=k))(keys)
        return set(np.unique(np.asarray(draws)).tolist())

    assert drawn(4) == drawn(9) == {0, 1, 2, 3}
    assert drawn(2) == {2, 3}


@pytest.mark.parametrize("bad, match", BAD_SAMPLING)
def test_bad_sampling_options_are_named(bad, match):
    logits = jnp.zeros((1, 4))
    with pytest.raises(ValueError, match=match):
        generation.sample(logits, jax.random.key(0), temperature=1.0, **bad)
    model, _ = _model("window", "model2")
    with pytest.raises(ValueError, match=match):
        sf.generate(model, np.zeros((1, 3), np.int32), 2, temperature=1.0, rngs=nnx.Rngs(0), **bad)


@pytest.mark.slow
def test_greedy_generation_of_a_mixture_of_experts_equals_recomputing_the_sequence():
    """DeepSeek-style MoE options no Hugging Face family here has (test_hf_moe.py has those):
    sigmoid routing with a selection bias, group-limited top-k, routed scaling, a shared
    expert, a first dense block; experts over an expert axis of 2, heads over model."""
    spec = sf.models.ModelSpec(
        "moe", hidden=32, heads=4, kv_heads=2, head_dim=8, ffn_hidden=64, num_layers=3,
        vocab_size=64, experts=4, top_k=2, expert_hidden=16, routing="sigmoid",
        expert_groups=2, topk_groups=1, routed_scaling=2.5, shared_experts=1,
        moe_first_dense=1,
    )  # fmt: skip
    mesh = jax.make_mesh((2, 2), ("expert", "model"), devices=jax.devices()[:4])
    model = sf.models.Transformer(spec, mesh=mesh, sequence_parallel=False, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Any(nnx.Param, sf.layers.router.SelectionBias))
    for path, value in nnx.to_flat_state(state):
        key = jax.random.fold_in(jax.random.key(1), zlib.crc32(str(path).encode()))
        noise = 0.3 * jax.random.normal(key, value.shape, value.dtype)
        value.set_value(jax.device_put(value[...] + noise, value[...].sharding))
    prompt = np.random.default_rng(0).integers(0, 64, (2, 5)).astype(np.int32)
    got = np.asarray(sf.generate(model, prompt, 8))
    seq = np.concatenate([prompt, got[:, :-1]], axis=1)
    with jax.set_mesh(mesh):
        logits = np.asarray(model(jnp.asarray(seq)))
    np.testing.assert_array_equal(got, logits[:, 4:].argmax(-1))
