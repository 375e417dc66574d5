"""Shared cases of the memory-toolkit tests: a tiny LM, padded batches, the one-device oracle."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from shardfuse.collectives.ring_attention import to_ring_layout
from shardfuse.models import ModelSpec, Transformer

VOCAB, FEATURES = 32, 32
# name -> (shape, axis names, batch spec of [B, T] token arrays)
MESHES = {
    "data2-fsdp4": ((2, 4), ("data", "fsdp"), P(("data", "fsdp"))),
    "fsdp2-seq2-model2": ((2, 2, 2), ("fsdp", "sequence", "model"), P("fsdp", "sequence")),
}


def mesh_of(name: str, explicit: bool = True):
    shape, names, _ = MESHES[name]
    types = None if explicit else (AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=types)


def batch_spec(mesh):
    """The batch spec of the `MESHES` entry with `mesh`'s axis names."""
    for _, names, spec in MESHES.values():
        if tuple(mesh.axis_names) == names:
            return spec
    raise KeyError(mesh.axis_names)


def make_lm(mesh, zero: int = 0, layers: int = 1, **kwargs):
    spec = ModelSpec.tiny(vocab_size=VOCAB, hidden=FEATURES, ffn_hidden=64, num_layers=layers)
    return Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0), zero=zero, **kwargs)


token_loss = Transformer.loss  # loss_fn(model, batch) -> (sum_loss, num_tokens)


def one_device_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))


def padded_batch(seed: int, batch: int = 32, length: int = 8):
    """tokens, targets, and a 0/1 mask keeping a random prefix of each row (1 to T tokens)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (batch, length))
    targets = rng.integers(0, VOCAB, (batch, length))
    lengths = rng.integers(1, length + 1, batch)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
    # poison what must not be read: padded targets are out of the vocabulary
    targets = np.where(mask > 0, targets, VOCAB + 7)
    return dict(
        tokens=jnp.asarray(tokens, jnp.int32),
        targets=jnp.asarray(targets, jnp.int32),
        mask=jnp.asarray(mask),
    )


def for_mesh(batch, mesh):
    """The batch in the ring (zigzag) order the sequence axis expects, when the mesh has one."""
    if "sequence" not in mesh.axis_names:
        return batch
    ring = mesh.shape["sequence"]
    return {k: to_ring_layout(v, ring, "zigzag") for k, v in batch.items()}


def reference_grads(model, batch):
    """Loss and gradients of the token-weighted mean, plainly (one device, one batch)."""

    def loss(model):
        s, n = token_loss(model, batch)
        return s / n

    return nnx.jit(nnx.value_and_grad(loss))(model)


def assert_trees_close(got, want, rtol, atol):
    """Every leaf of two `nnx.State`s (same paths) within tolerances, finite."""
    got, want = dict(nnx.to_flat_state(got)), dict(nnx.to_flat_state(want))
    assert got.keys() == want.keys()
    for path in want:
        g, w = np.asarray(got[path][...]), np.asarray(want[path][...])
        assert np.all(np.isfinite(g)) and np.all(np.isfinite(w)), path
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=str(path))
