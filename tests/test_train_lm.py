"""The Llama-style example: its loss falls on each mesh; checkpoints restore on another mesh."""

import numpy as np
import pytest
from flax import nnx

from shardfuse.demos.llama import LlamaConfig
from shardfuse.demos.train_lm import TrainConfig, Trainer, parse_mesh

TINY = LlamaConfig(vocab=64, features=32, heads=4, kv_heads=2, hidden=64, layers=2)


def _config(mesh, **kwargs):
    base = dict(mesh=mesh, model=TINY, steps=6, global_batch=8, seq_len=16, learning_rate=1e-2)
    return TrainConfig(**{**base, **kwargs})


def _params(model):
    return {
        str(path): np.asarray(leaf) for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param("data=8", id="data"),
        pytest.param("data=2,sequence=2,model=2", id="data-sequence-model"),
    ],
)
def test_example_loss_falls(mesh):
    losses = Trainer(_config(parse_mesh(mesh)), log=lambda line: None).run()
    assert len(losses) == 6 and np.all(np.isfinite(losses)), losses
    assert losses[-1] < 0.9 * losses[0], losses


def test_checkpoint_restores_on_another_mesh(tmp_path):
    saved = Trainer(
        _config({"data": 2, "model": 4}, steps=2, checkpoint_dir=str(tmp_path)),
        log=lambda line: None,
    )
    saved.run()
    at_step_2 = _params(saved.model)
    saved.checkpointer = None  # continue in memory: the oracle for step 3
    saved.config.steps = 3
    (want,) = saved.run()

    restored = Trainer(
        _config({"data": 4, "sequence": 2}, steps=3, checkpoint_dir=str(tmp_path)),
        log=lambda line: None,
    )
    assert restored.step == 2
    got_params = _params(restored.model)
    assert got_params.keys() == at_step_2.keys()
    for name, value in at_step_2.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
    assert restored.model.head.kernel.sharding.mesh.shape["data"] == 4
    (got,) = restored.run()
    assert abs(got - want) <= 1e-6, (got, want)


def test_bad_mesh_is_refused():
    with pytest.raises(ValueError, match="has 4 devices"):
        Trainer(_config({"data": 4}), log=lambda line: None)
    with pytest.raises(ValueError, match="AXIS=SIZE"):
        parse_mesh("tensor=8")
