"""`sf.models.Transformer` sharded == the same model on one device; the spec's checks.

Oracle (TESTING.md, the toolkit rule): the same spec and parameters on a 1-device
mesh (every axis of size 1), one batch, no pipeline. Compared: the logits and
the loss and EVERY gradient leaf (embedding, position table, stacked blocks,
head), float32, rtol 1e-5 / atol 4e-5. Two architectures: Llama-style (RoPE,
GQA, SwiGLU, RMSNorm, untied) and GPT-style (GELU, LayerNorm, learned
positions, tied embeddings, biases); Qwen2-style q/k/v bias and no positions
in the slow set. Meshes: data x model; sequence x model (ring attention,
tokens in the zigzag layout); fsdp x model with ZeRO-3 per shard through
`sf.parallel.accumulate`; pipeline x model through `sf.parallel.Pipeline`.
"""

import doctest
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import shardfuse as sf
from shardfuse.layers import loss as loss_module
from shardfuse.models import ModelSpec, Transformer, transformer
from shardfuse.parallel.accumulate import accumulate
from shardfuse.parallel.pipeline.api import Pipeline
from tests.parallel.pipeline_models import assert_trees_close

RTOL, ATOL = 1e-5, 4e-5
VOCAB, SEQ, BATCH = 32, 16, 4

LLAMA = ModelSpec.tiny("llama", vocab_size=VOCAB, hidden=16, heads=4, kv_heads=2,
                       ffn_hidden=32, num_layers=2)  # fmt: skip
GPT = ModelSpec.tiny("gpt", vocab_size=VOCAB, hidden=16, heads=4, kv_heads=4, ffn_hidden=32,
                     num_layers=2, activation="gelu", norm="layernorm", norm_eps=1e-5,
                     positions="learned", max_positions=SEQ, tied_embeddings=True,
                     use_bias=True)  # fmt: skip
QWEN = LLAMA.replace(name="qwen", qkv_bias=True, rope_theta=1e6, window=6)
NOPE = GPT.replace(name="nope", positions="none", max_positions=None, tied_embeddings=False)
SPECS = {"llama": LLAMA, "gpt": GPT, "qwen": QWEN, "nope": NOPE}


def _mesh(shape, names, explicit=True):
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
    devices = jax.devices()[: math.prod(shape)]
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)


def _batch(seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, VOCAB)
    targets = jax.random.randint(jax.random.key(seed + 1), (BATCH, SEQ), 0, VOCAB)
    mask = (jax.random.uniform(jax.random.key(seed + 2), (BATCH, SEQ)) > 0.2).astype(jnp.float32)
    return dict(tokens=tokens, targets=targets, mask=mask)


def _ring(batch, mesh):
    """The batch in the zigzag ring order the sequence axis expects (when the mesh has one)."""
    ring = mesh.shape.get("sequence", 1)
    return {k: sf.to_ring_layout(v, ring, "zigzag") for k, v in batch.items()}


def _reference(model, spec, names):
    """The same spec and parameter values on a 1-device mesh (the oracle)."""
    mesh = _mesh((1,) * len(names), names, explicit=False)
    reference = Transformer(spec, mesh=mesh, rngs=nnx.Rngs(1))
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.update(reference, jax.tree.map(np.asarray, values))
    return reference


def _mean_loss(model, batch):
    total, count = model.loss(batch)
    return total / count


def _value_and_grad(fn, model, *args, mesh):
    with jax.set_mesh(mesh):  # Explicit axes: the loss's transpose builds zeros on the mesh
        return nnx.jit(nnx.value_and_grad(fn))(model, *args)


_REFERENCE_RESULTS = {}


def _fingerprint(model):
    """A digest of every parameter's path and value (bitwise)."""
    digest = hashlib.sha256()
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        digest.update(repr(path).encode())
        digest.update(np.ascontiguousarray(np.asarray(value[...])).tobytes())
    return digest.hexdigest()


def _reference_results(spec, model, batch):
    """The oracle's logits, loss and gradients on the default batch, once per spec and
    parameter values. `Transformer(spec, rngs=nnx.Rngs(0))` draws the same values on every
    mesh (sharded, ZeRO-3, pipelined), so the one-device oracle (the same spec and values
    on a 1-device mesh) is computed once for all the tests of a spec instead of once per
    mesh. Keyed by a bitwise digest of the parameters: different values, another oracle."""
    assert batch is not None and all(
        np.array_equal(np.asarray(batch[k]), np.asarray(v)) for k, v in _batch().items()
    ), "the cached oracle is for the default batch"
    key = (spec, _fingerprint(model))
    if key not in _REFERENCE_RESULTS:
        reference = _reference(model, spec, ("data", "model"))
        logits = reference(batch["tokens"])
        loss, grads = nnx.jit(nnx.value_and_grad(_mean_loss))(reference, batch)
        _REFERENCE_RESULTS[key] = logits, loss, grads
    return _REFERENCE_RESULTS[key]


def _check(spec, shape, names, *, explicit=True, **options):
    mesh = _mesh(shape, names, explicit)
    model = Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0), **options)
    batch = _batch()
    logits, loss, grads = _reference_results(spec, model, batch)
    assert np.all(np.isfinite(np.asarray(logits)))
    ring = mesh.shape.get("sequence", 1)
    with jax.set_mesh(mesh):
        got = sf.from_ring_layout(model(_ring(batch, mesh)["tokens"]), ring, "zigzag")
    np.testing.assert_allclose(got, logits, rtol=RTOL, atol=ATOL)
    got_loss, got_grads = _value_and_grad(_mean_loss, model, _ring(batch, mesh), mesh=mesh)
    np.testing.assert_allclose(got_loss, loss, rtol=RTOL, atol=ATOL)
    assert_trees_close(got_grads, grads)


@pytest.mark.parametrize(
    "spec, shape, names",
    [
        pytest.param(
            "llama", (2, 4), ("data", "model"), id="llama-data-model", marks=pytest.mark.slow
        ),
        pytest.param("gpt", (2, 2), ("sequence", "model"), id="gpt-sequence-model"),
        pytest.param("gpt", (2, 4), ("data", "model"), id="gpt-data-model", marks=pytest.mark.slow),
        pytest.param(
            "llama",
            (2, 2, 2),
            ("data", "sequence", "model"),
            id="llama-data-sequence-model",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "qwen", (2, 2), ("sequence", "model"), id="qwen-sequence-model", marks=pytest.mark.slow
        ),
        pytest.param(
            "nope", (4, 2), ("data", "model"), id="nope-data-model", marks=pytest.mark.slow
        ),
    ],
)
def test_sharded_equals_one_device(spec, shape, names):
    _check(SPECS[spec], shape, names)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["llama", "gpt"])
def test_zero3_plain_call_equals_one_device(spec):
    _check(SPECS[spec], (4, 2), ("fsdp", "model"), explicit=False, zero=3)


@pytest.mark.parametrize(
    "spec",
    ["gpt", pytest.param("llama", marks=pytest.mark.slow)],
)
def test_zero3_per_shard_accumulate_equals_one_device(spec):
    """Per shard (the full-manual region of `accumulate`): embedding lookup, this sequence
    shard's learned positions, sequence parallelism, the tied head's gathers."""
    spec = SPECS[spec]
    names = ("fsdp", "sequence", "model")
    mesh = _mesh((2, 2, 2), names)
    model = Transformer(spec, mesh=mesh, zero=3, rngs=nnx.Rngs(0))
    batch = _batch()
    _, loss, grads = _reference_results(spec, model, batch)
    grad_fn = accumulate(
        Transformer.loss, 2, mesh=mesh, zero=3, batch_spec=jax.P("fsdp", "sequence")
    )
    with jax.set_mesh(mesh):
        got_loss, got_grads = nnx.jit(grad_fn)(model, _ring(batch, mesh))
    np.testing.assert_allclose(got_loss, loss, rtol=RTOL, atol=ATOL)
    assert_trees_close(got_grads, grads)


def _pipelined_loss(model, batch, schedule, m):
    pipe = Pipeline(model.blocks, mesh=model.mesh, schedule=schedule, num_microbatches=m)
    x = model.embed_tokens(batch["tokens"])
    return pipe.loss(
        x, batch["targets"], head=model.head, weights=batch["mask"], targets_spec=jax.P("data")
    )


@pytest.mark.parametrize(
    "spec", [pytest.param("gpt", marks=pytest.mark.slow), pytest.param("llama")]
)
def test_pipelined_equals_one_device(spec):
    spec = SPECS[spec]
    names = ("pipeline", "data", "model")
    mesh = _mesh((2, 2, 2), names)
    model = Transformer(spec, mesh=mesh, pipelined=True, rngs=nnx.Rngs(0))
    batch = _batch()
    _, loss, grads = _reference_results(spec, model, batch)
    got_loss, got_grads = _value_and_grad(
        lambda model, batch: _pipelined_loss(model, batch, "1f1b", 2), model, batch, mesh=mesh
    )
    np.testing.assert_allclose(got_loss, loss, rtol=RTOL, atol=ATOL)
    assert_trees_close(got_grads, grads)


def test_learned_positions_are_read_at_natural_positions():
    """Planted bug: a model that adds the position rows in slot order (ignoring the ring
    layout) differs from the one-device model, so the comparisons above can fail."""
    mesh = _mesh((2,), ("sequence",))
    model = Transformer(GPT, mesh=mesh, rngs=nnx.Rngs(0))
    batch = _batch()
    reference = _reference(model, GPT, ("sequence",))(batch["tokens"])
    model.positions = lambda seq_len: jnp.arange(seq_len, dtype=jnp.int32)  # the planted bug
    with jax.set_mesh(mesh):
        wrong = sf.from_ring_layout(model(_ring(batch, mesh)["tokens"]), 2, "zigzag")
    assert np.max(np.abs(np.asarray(wrong) - np.asarray(reference))) > 1e-3


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_num_params_counts_the_model(spec):
    """`ModelSpec.num_params()` (what the planner and flops read) == the model's parameters."""
    spec = SPECS[spec]
    model = Transformer(spec, mesh=_mesh((1,), ("model",)), rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(state)) == spec.num_params()
    assert sf.flops.layer_matmul_flops(spec) == 2 * spec.layer_matmul_params()


def test_model_options():
    spec = GPT
    model = Transformer(spec, mesh=_mesh((2,), ("model",)), rngs=nnx.Rngs(0))
    assert model.head.unembed.embed is model.embed  # tied: one parameter
    assert model.pos_embed.shape == (SEQ, 16)
    block = model.blocks.blocks
    assert block.attention.rope_theta is None and block.norm_1.kind == "layernorm"
    assert block.attention.o_bias is not None and block.mlp.activation == "gelu"
    qwen = Transformer(QWEN, mesh=_mesh((2,), ("model",)), rngs=nnx.Rngs(0))
    attention = qwen.blocks.blocks.attention
    assert attention.q_bias is not None and attention.kv_bias is not None
    assert attention.o_bias is None and qwen.blocks.blocks.mlp.up.bias is None
    assert attention.rope_theta == 1e6 and attention.window == (5, 0)
    assert qwen.pos_embed is None and not isinstance(qwen.head.unembed, type(model.head.unembed))


def test_bad_model_input():
    mesh = _mesh((1,), ("model",))
    with pytest.raises(TypeError, match="spec=.* must be an sf.models.ModelSpec"):
        Transformer({"hidden": 16}, mesh=mesh, rngs=nnx.Rngs(0))
    model = Transformer(GPT, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"exceeds spec.max_positions={SEQ}"):
        model(jnp.zeros((1, 2 * SEQ), jnp.int32))


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_sizes_the_mesh_does_not_divide_are_named(explicit):
    """A batch or sequence length that its mesh axes do not split evenly: named, not a raw
    sharding error from deep inside the embedding or the blocks."""
    mesh = _mesh((2, 2), ("data", "model"), explicit)
    model = Transformer(LLAMA, mesh=mesh, rngs=nnx.Rngs(0))  # sequence_parallel: over model
    with jax.set_mesh(mesh):
        with pytest.raises(
            ValueError, match=r"sequence length 5 is not divisible by 2.*\('model',\)"
        ):
            model(jnp.zeros((2, 5), jnp.int32))
        with pytest.raises(ValueError, match=r"batch size 3 is not divisible by 2.*\('data',\)"):
            model(jnp.zeros((3, 4), jnp.int32))
        assert model(jnp.zeros((2, 4), jnp.int32)).shape == (2, 4, LLAMA.vocab_size)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(norm="batchnorm"), "norm='batchnorm' must be one of"),
        (dict(positions="alibi"), "positions='alibi' must be one of"),
        (dict(positions="learned"), "max_positions=None: positions='learned' needs"),
        (dict(positions="learned", max_positions=0), "max_positions=0 must be None or a positive"),
        (dict(norm_eps=0.0), "norm_eps=0.0 must be a positive number"),
        (dict(rope_theta=-1.0), "rope_theta=-1.0 must be a positive number"),
        (dict(use_bias=1), "use_bias=1 must be a bool"),
        (dict(qkv_bias="yes"), "qkv_bias='yes' must be a bool"),
        (dict(tied_embeddings=None), "tied_embeddings=None must be a bool"),
        (dict(window=0), "window=0 must be None or a positive int"),
        (dict(logit_softcap=-5.0), "logit_softcap=-5.0 must be a positive number"),
        (dict(head_dim=5), "head_dim=5 must be even with positions='rope'"),
        (dict(activation="relu"), "activation='relu' must be one of"),
    ],
)
def test_spec_rejects_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        LLAMA.replace(**fields)


def test_spec_constructors():
    assert ModelSpec.tiny().num_layers == 4 and ModelSpec.tiny().head_dim == 16
    assert ModelSpec.tiny(head_dim=5, positions="none").head_dim == 5  # odd D without RoPE
    with pytest.raises(ValueError, match="hidden=10 must be a multiple of heads=4"):
        ModelSpec.tiny(hidden=10)
    # the published models are unchanged by the new fields
    llama = sf.models.get("llama3-8b")
    assert (llama.norm, llama.positions, llama.use_bias, llama.qkv_bias) == (
        "rmsnorm",
        "rope",
        False,
        False,
    )


@pytest.mark.parametrize("module", [transformer, loss_module], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0, f"{result.failed} failing examples in {module.__name__}"


def test_token_loss_is_token_weighted_and_ignores_padding():
    """The one loss: `(sum(w * ce), sum(w))` against optax, padding (out-of-range targets,
    weight 0) contributes nothing to the value or the gradient; bad shapes are named."""
    import optax

    logits = jax.random.normal(jax.random.key(0), (3, 5, VOCAB))
    targets = jax.random.randint(jax.random.key(1), (3, 5), 0, VOCAB)
    weights = jnp.asarray(np.random.default_rng(0).integers(0, 2, (3, 5)), jnp.float32)
    poisoned = jnp.where(weights > 0, targets, VOCAB + 7)  # padded targets out of range
    total, count = sf.layers.token_loss(logits, poisoned, weights)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    np.testing.assert_allclose(total, jnp.sum(ce * weights), rtol=1e-6)
    assert float(count) == float(weights.sum())
    grad = jax.grad(lambda x: sf.layers.token_loss(x, poisoned, weights)[0])(logits)
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[np.asarray(weights) == 0] == 0)
    total, count = sf.layers.token_loss(logits, targets)
    np.testing.assert_allclose(total, jnp.sum(ce), rtol=1e-6)
    assert float(count) == 15.0
    with pytest.raises(ValueError, match="targets has shape \\(3,\\); expected"):
        sf.layers.token_loss(logits, targets[:, 0])
    with pytest.raises(TypeError, match="targets has dtype float32"):
        sf.layers.token_loss(logits, targets.astype(jnp.float32))
    with pytest.raises(ValueError, match="weights has shape"):
        sf.layers.token_loss(logits, targets, weights[:, :2])


def test_tied_head_splits_the_logits_over_the_model_axis():
    """The training step's matmul work is the same tied or untied, data or model parallel.

    The tied head computed every logit on every model shard (the table replicated):
    the compiled step of a GPT-style model on data 2 x model 4 executed 32% more dot
    FLOPs than on data 8 or untied. Counted in the optimized HLO of the trainer's step
    (`tests/parallel/pipeline_flops.executed_flops`), per device times devices.
    """
    from shardfuse.train import TrainConfig, Trainer
    from tests.parallel.pipeline_flops import executed_flops

    def step_flops(tied, mesh):
        spec = GPT.replace(tied_embeddings=tied, vocab_size=256, max_positions=32)
        config = TrainConfig(model=spec, mesh=mesh, global_batch=8, seq_len=32, steps=1)
        trainer = Trainer(config, log=lambda line: None)
        step, args = trainer.step_call()
        with jax.set_mesh(trainer.mesh):
            return executed_flops(step.lower(*args).compile().as_text()) * jax.device_count()

    untied = step_flops(False, {"data": 2, "model": 4})
    assert step_flops(True, {"data": 2, "model": 4}) == pytest.approx(untied, rel=1e-9)
    assert step_flops(True, {"data": 8}) == pytest.approx(untied, rel=1e-9)
