"""`sf.parallel.Checkpointer` across stage layouts: uneven pipeline stages pad the stacked
layers with zero rows (`Stack(stage_layers=...)`), and a checkpoint must put every layer,
and its optimizer moments, back in the right row of whatever layout restores it."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import shardfuse as sf
from shardfuse.parallel import Checkpointer, RunOptions, parallelize

AXES = ("pipeline", "data", "fsdp", "sequence", "model")
LAYERS = 10
SPEC = sf.models.ModelSpec.tiny(
    vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, num_layers=LAYERS
)
ROWS = np.random.default_rng(0).integers(0, 64, (16, 17)).astype(np.int32)


def _run(pipeline, data, seed):
    mesh = jax.make_mesh((pipeline, data, 1, 1, 1), AXES, devices=jax.devices()[: pipeline * data])
    options = RunOptions(num_microbatches=4 if pipeline > 1 else 1)
    return parallelize(SPEC, options, mesh, optimizer=optax.adamw(1e-2), rngs=nnx.Rngs(seed))


def _step(run):
    with jax.set_mesh(run.mesh):
        return float(run.step(run.model, run.optimizer, jax.device_put(ROWS, run.batch_sharding)))


def _in_layer_order(run):
    """Every array of the model and optimizer, a stacked one as `[LAYERS, ...]` in layer order."""
    rows = run.model.blocks.layer_rows()
    order = [rows.index(layer) for layer in range(LAYERS)]
    state = {name: nnx.to_pure_dict(nnx.state(node))
             for name, node in (("model", run.model), ("optimizer", run.optimizer))}  # fmt: skip
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        key = jax.tree_util.keystr(path)
        x = np.asarray(x)
        out[key] = x[order] if "['blocks']" in key and x.shape[:1] == (len(rows),) else x
    return out


@pytest.mark.parametrize("target", [(3, 1), (1, 2)], ids=["pipeline3", "no-pipeline"])
def test_uneven_stages_restore_onto_another_stage_layout(tmp_path, target):
    """10 layers on pipeline 4 are stages (3, 3, 2, 2) in 12 padded rows; on pipeline 3
    (4, 3, 3), also 12 rows, where row 8 holds layer 7, not layer 8. Before the
    checkpoint saved the layers in order, orbax restored the rows as they were: layer 7
    came back as a padding row of zeros, and the loss moved by 3e-3 with no error."""
    saved = _run(4, 2, seed=0)
    _step(saved)  # the optimizer moments are nonzero
    checkpointer = Checkpointer(tmp_path, every=1)
    checkpointer.save(1, saved.model, saved.optimizer, force=True)
    checkpointer.wait()
    restored = _run(*target, seed=1)
    assert checkpointer.restore(restored.model, restored.optimizer)["step"] == 1
    checkpointer.close()
    want, got = _in_layer_order(saved), _in_layer_order(restored)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    padding = [r for r, layer in enumerate(restored.model.blocks.layer_rows()) if layer < 0]
    scale = np.asarray(restored.model.blocks.blocks.norm_1.scale[...])
    assert not scale[padding].any()  # padding rows stay zero
    np.testing.assert_allclose(_step(restored), _step(saved), rtol=2e-6)
