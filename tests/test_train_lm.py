"""The Llama-style example: its loss falls on each mesh; checkpoints restore on another mesh."""

import numpy as np
import pytest
from flax import nnx

from shardfuse.models import ModelSpec
from shardfuse.parallel import RunOptions
from shardfuse.train import TrainConfig, Trainer, parse_mesh

TINY = ModelSpec.tiny(vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, num_layers=2)


def _config(mesh, options=None, **kwargs):
    base = dict(mesh=mesh, model=TINY, steps=6, global_batch=8, seq_len=16, learning_rate=1e-2)
    return TrainConfig(**{**base, **kwargs}, options=RunOptions(**(options or {})))


def _params(model):
    return {
        str(path): np.asarray(leaf) for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.parametrize(
    "mesh, options",
    [
        pytest.param("data=8", {}, id="data"),
        pytest.param("fsdp=8", dict(zero=3), id="fsdp-zero3", marks=pytest.mark.slow),
        pytest.param(
            "pipeline=2,model=4",
            dict(num_microbatches=2),
            id="pipeline-model",
            marks=pytest.mark.slow,
        ),
        pytest.param("data=2,sequence=2,model=2", {}, id="data-sequence-model"),
        pytest.param(
            "pipeline=2,data=1,fsdp=2,sequence=1,model=2",
            dict(zero=3, num_microbatches=2, schedule="zb-h1", remat="selective"),
            id="five-axes",
        ),
    ],
)
def test_example_loss_falls(mesh, options):
    losses = Trainer(_config(parse_mesh(mesh), options), log=lambda line: None).run()
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

    restored = Trainer(  # saved on data 2 x model 4, restored on fsdp 4 x pipeline 2
        _config(
            {"fsdp": 4, "pipeline": 2},
            steps=3,
            checkpoint_dir=str(tmp_path),
            options=dict(zero=3, num_microbatches=2),
        ),
        log=lambda line: None,
    )
    assert restored.step == 2
    got_params = _params(restored.model)
    assert got_params.keys() == at_step_2.keys()
    for name, value in at_step_2.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
    kernel = restored.model.head.unembed.kernel[...]
    assert kernel.sharding.spec[0] == "fsdp" and kernel.sharding.mesh.shape["fsdp"] == 4
    (got,) = restored.run()
    # the next step's loss on the other mesh: a different reduction order, a few float32
    # ulps of a loss near 4 (1.4e-6 measured on jax 0.12)
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (got, want)


def test_bad_mesh_is_refused():
    with pytest.raises(ValueError, match="has 4 devices"):
        Trainer(_config({"data": 4}), log=lambda line: None)
    with pytest.raises(ValueError, match="AXIS=SIZE"):
        parse_mesh("tensor=8")


def test_token_streams_are_per_row_and_deterministic(tmp_path):
    from shardfuse.train.data import CORPUS, SyntheticTokens, TextTokens

    for stream in (SyntheticTokens(64, 16, seed=3), TextTokens(CORPUS, 16, seed=3)):
        whole = stream.rows(5, 0, 8)
        assert whole.shape == (8, 17) and whole.dtype == np.int32
        # A process loading rows 4..7 alone gets exactly those rows of the batch.
        np.testing.assert_array_equal(stream.rows(5, 4, 8), whole[4:])
        assert not np.array_equal(stream.rows(6, 0, 8), whole)  # the next step differs
    text = TextTokens(CORPUS, 16).rows(0, 0, 2)
    assert bytes(text[0].astype(np.uint8)) in CORPUS.read_bytes()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("short")
    with pytest.raises(ValueError, match="needs more than seq_len"):
        TextTokens(tiny, 16)


@pytest.mark.slow
def test_text_data_trains():
    losses = Trainer(
        _config(
            {"data": 8},
            model=ModelSpec.tiny(vocab_size=256, hidden=32, ffn_hidden=64, num_layers=1),
            data="text",
            steps=4,
        ),
        log=lambda line: None,
    ).run()
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_docstring_examples_of_the_train_package():
    import doctest
    import importlib

    for name in ("shardfuse.train", "shardfuse.train.trainer"):
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, (name, result)


def test_trains_from_a_hugging_face_checkpoint_and_exports_one(tmp_path):
    """--init-from DIR, 2 steps, --export-hf DIR: the export loads back as the trained model."""
    hf = pytest.importorskip("shardfuse.models.hf")
    import importlib.util
    import pathlib

    import jax

    import shardfuse as sf

    source = sf.models.Transformer(TINY, mesh=jax.make_mesh((8,), ("data",)), rngs=nnx.Rngs(3))
    hf.save_hf(source, tmp_path / "in")
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("train_lm_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = ["--mesh", "data=2,model=4", "--steps", "2", "--batch", "8", "--seq-len", "16",
            "--init-from", str(tmp_path / "in"), "--export-hf", str(tmp_path / "out")]  # fmt: skip
    trainer = example.setup(example.parse_args(argv))
    before = _params(trainer.model)
    want_before = _params(source)
    assert before.keys() == want_before.keys()
    for name, value in want_before.items():  # it starts from the checkpoint, not a fresh init
        np.testing.assert_array_equal(before[name], value, err_msg=name)
    losses = trainer.run()
    assert len(losses) == 2 and np.all(np.isfinite(losses))
    trained = _params(trainer.model)
    assert any(not np.array_equal(trained[k], before[k]) for k in trained)  # it trained
    loaded = _params(hf.load_hf(tmp_path / "out", mesh=trainer.mesh))
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_init_from_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="init_from=.*no config.json"):
        Trainer(_config({"data": 8}, init_from=str(tmp_path)), log=lambda line: None)


def test_the_run_choices_are_one_run_options():
    """`TrainConfig.options` is the `sf.parallel.RunOptions` the run applies; the keywords of
    earlier releases (copies of its fields) set them with a DeprecationWarning."""
    config = TrainConfig(mesh={"data": 8}, options=RunOptions(zero=1, num_microbatches=2))
    assert config.run_options() is config.options
    with pytest.warns(
        DeprecationWarning,
        match=r"TrainConfig\(zero=\.\.\., microbatches=\.\.\.\) "
        r"is deprecated .*: use options=RunOptions\(zero=\.\.\., num_microbatches=",
    ):
        old = TrainConfig(mesh={"data": 8}, zero=1, microbatches=2)  # fmt: skip
    assert old == config
    with pytest.raises(TypeError, match="options=3 must be an sf.parallel.RunOptions"):
        TrainConfig(options=3)


def _example():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("train_lm_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="dropless"),
        pytest.param(["--shared-experts", "1", "--capacity-factor", "1.0"], id="shared-capacity"),
    ],
)
def test_moe_example_trains_on_an_expert_mesh_and_reports_the_aux_loss(extra):
    """`--mesh expert=4,data=2 --experts 8 --top-k 2`: the loss falls, each step's line
    prints the aux loss and the expert load, the history holds tokens per expert."""
    example = _example()
    argv = ["--mesh", "expert=4,data=2", "--experts", "8", "--top-k", "2", "--steps", "6",
            "--batch", "8", "--seq-len", "16", "--layers", "2", "--features", "32",
            "--hidden", "32", "--vocab", "64", "--lr", "1e-2", *extra]  # fmt: skip
    lines = []
    trainer = example.setup(example.parse_args(argv))
    trainer._log = lines.append
    losses = trainer.run()
    assert len(losses) == 6 and np.all(np.isfinite(losses)), losses
    assert losses[-1] < 0.9 * losses[0], losses
    assert all("aux_loss" in line and "expert_load" in line for line in lines), lines
    record = trainer.history[-1]
    assert len(record["tokens_per_expert"]) == 2  # a list of [E] per MoE layer
    assert [sum(c) for c in record["tokens_per_expert"]] == [8 * 16 * 2] * 2
    assert record["aux_loss"] >= 2 * 0.99  # >= 1 a layer (1: balanced)
    assert record["expert_load"] >= 1.0


@pytest.mark.slow
def test_moe_checkpoint_restores_on_another_expert_layout(tmp_path):
    """A first dense block then MoE blocks (two Stacks), saved on expert=4 and restored on
    expert=2: every parameter equal."""
    spec = TINY.replace(num_layers=3, experts=8, top_k=2, moe_first_dense=1)
    config = dict(model=spec, steps=2, global_batch=8, seq_len=16, checkpoint_dir=str(tmp_path))
    saved = Trainer(TrainConfig(mesh={"expert": 4, "data": 2}, **config), log=lambda line: None)
    saved.run()
    restored = Trainer(TrainConfig(mesh={"expert": 2, "data": 4}, **config), log=lambda line: None)
    assert restored.step == 2
    want, got = _params(saved.model), _params(restored.model)
    assert want.keys() == got.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
