"""Hugging Face mixtures of experts in and out, against `transformers` (the oracle).

Tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE models are built with
`transformers` (torch on CPU, no download), saved with `save_pretrained` (per-expert
tensors), loaded into shardfuse on five meshes (data x model, expert x data, expert x
model, pipeline x expert x data, fsdp (ZeRO-3) x expert) and compared: logits in float32
within 1e-4, greedy generation token for token, the export (bitwise the same tensors,
and `transformers` loads it), the fused expert layout transformers holds in memory,
and the bytes each device reads. One mesh per family runs quick, the rest are `slow`.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from shardfuse.models import hf, hf_reads
from shardfuse.models.safetensors import SafetensorsDir, write_safetensors
from tests.models.test_hf import (
    assert_greedy_generation_matches,
    hf_logits,
    tokens,
)  # the dense families' helpers (vocab 128)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = dict(
    hidden_size=64,
    intermediate_size=48,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=128,
    max_position_embeddings=256,
    num_experts_per_tok=2,
)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, dict(num_hidden_layers=2, num_local_experts=8)),
    "qwen2_moe": (  # block 1 dense (mlp_only_layers): two runs of blocks of one kind
        transformers.Qwen2MoeConfig,
        dict(
            num_hidden_layers=3,
            num_experts=8,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),  # fmt: skip
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_hidden_layers=2,
            num_experts=8,
            moe_intermediate_size=16,
            head_dim=8,
            norm_topk_prob=True,
        ),
    ),  # fmt: skip
    "olmoe": (  # clip_qkv below the projections' range: it clamps
        transformers.OlmoeConfig,
        dict(
            num_hidden_layers=2,
            num_experts=8,
            clip_qkv=1.5,
            norm_topk_prob=False,
            eos_token_id=None,
            pad_token_id=None,
        ),
    ),  # fmt: skip
}
# mesh shape, axis names, load options
MESHES = {
    "data2_model4": ((2, 4), ("data", "model"), {}),
    "expert4_data2": ((4, 2), ("expert", "data"), {}),
    "expert2_model4": ((2, 4), ("expert", "model"), {}),
    "pipeline2_expert2_data2": ((2, 2, 2), ("pipeline", "expert", "data"), dict(pipelined=True)),
    "fsdp4_expert2_zero3": ((4, 2), ("fsdp", "expert"), dict(zero=3)),
}
QUICK = [
    ("mixtral", "expert4_data2"),
    ("qwen2_moe", "data2_model4"),
    ("qwen3_moe", "expert2_model4"),
    ("olmoe", "fsdp4_expert2_zero3"),
]
ALL = [(f, m) for f in FAMILIES for m in MESHES]


def cases(quick):
    return [pytest.param(f, m, marks=() if (f, m) in quick else pytest.mark.slow) for f, m in ALL]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (directory, the transformers model)."""
    out = {}
    for i, (family, (config_cls, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(10 + i)
        config = config_cls(**SIZES, **extra)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # larger weights than the 0.02 default: clear argmax margins
            for p in model.parameters():
                if p.ndim >= 2:
                    p.normal_(0.0, 0.2)
                else:
                    p.add_(torch.randn_like(p) * 0.1)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = (path, model)
    # A pipeline runs one kind of block: Qwen2-MoE with every block sparse for its mesh
    torch.manual_seed(20)
    config_cls, extra = FAMILIES["qwen2_moe"]
    config = config_cls(**SIZES, **{**extra, "mlp_only_layers": [], "num_hidden_layers": 2})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("qwen2_moe_sparse")
    model.save_pretrained(path)
    out["qwen2_moe", "pipeline"] = (path, model)
    return out


def checkpoint(checkpoints, family, mesh_name):
    """`(path, transformers model)` of `family` for `mesh_name` (on the pipeline mesh, the
    all-sparse Qwen2-MoE: a Pipeline runs one kind of block)."""
    if family == "qwen2_moe" and MESHES[mesh_name][2].get("pipelined"):
        return checkpoints["qwen2_moe", "pipeline"]
    return checkpoints[family]


def make_mesh(mesh_name, axis_type=AxisType.Explicit):
    shape, names, options = MESHES[mesh_name]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names)), options


def load(path, mesh_name, axis_type=AxisType.Explicit, **extra):
    mesh, options = make_mesh(mesh_name, axis_type)
    return hf.load_hf(path, mesh=mesh, **options, **extra), mesh


def _state(model):
    return nnx.state(model, nnx.Param)


def test_the_families_expected_checkpoint_layout(checkpoints):
    """What the tests load is what transformers 5 writes: one tensor per expert."""
    names = SafetensorsDir(checkpoints["mixtral"][0]).names()
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in names
    names = SafetensorsDir(checkpoints["qwen2_moe"][0]).names()
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense block
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names


def test_specs_of_the_families(checkpoints):
    specs = {f: hf.read_hf_spec(checkpoints[f][0]) for f in FAMILIES}
    assert specs["qwen2_moe"].moe_layers == (0, 2)
    assert specs["qwen2_moe"].shared_expert_gate and not specs["qwen2_moe"].normalize_top_k
    assert specs["mixtral"].normalize_top_k and specs["qwen3_moe"].normalize_top_k
    assert (specs["qwen3_moe"].qk_norm, specs["olmoe"].qk_norm) == ("head", "flat")
    assert specs["olmoe"].clip_qkv == 1.5
    # the sparse blocks are those transformers builds a sparse MLP for
    for family in FAMILIES:
        reference = checkpoints[family][1]
        sparse = [i for i, layer in enumerate(reference.model.layers)
                  if hasattr(layer.mlp, "experts")]  # fmt: skip
        assert list(specs[family].moe_layers) == sparse, family


@pytest.mark.parametrize("family, mesh_name", cases(QUICK))
def test_logits_match_transformers(checkpoints, family, mesh_name):
    path, reference = checkpoint(checkpoints, family, mesh_name)
    model, _ = load(path, mesh_name)
    toks = tokens()
    ours = np.asarray(model(jnp.asarray(toks, jnp.int32)))
    np.testing.assert_allclose(ours, hf_logits(reference, toks), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_olmoe_clip_qkv_clamps(checkpoints, tmp_path):
    """A clip that matters: without it the logits differ (so the clamp is computed)."""
    path, reference = checkpoints["olmoe"]
    unclipped = _copy(path, tmp_path / "unclipped", clip_qkv=None)
    model, _ = load(unclipped, "expert4_data2")
    toks = tokens()
    ours = np.asarray(model(jnp.asarray(toks, jnp.int32)))
    assert np.abs(ours - hf_logits(reference, toks)).max() > 1e-2


def assert_export_round_trips(path, reference, tmp_path, family):
    """`save_hf` of the checkpoint loaded on expert 2 x model 4 writes its tensors
    bitwise, `load_hf` of the export gives the same parameters, and `transformers` loads
    it to the same logits. Returns `(model, again, config)`."""
    model, mesh = load(path, "expert2_model4")
    out = hf.save_hf(model, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    original, ours = SafetensorsDir(path), SafetensorsDir(out)
    assert ours.names() == original.names()
    for name in original.names():  # bitwise: our parameters hold the checkpoint's bits
        assert np.array_equal(ours.read(name), original.read(name)), name
    again = hf.load_hf(out, mesh=mesh)
    pairs = zip(hf._params(_state(model)), hf._params(_state(again)), strict=True)
    for (p, a), (_, b) in pairs:
        assert np.array_equal(np.asarray(a[...]), np.asarray(b[...])), p
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    toks = tokens(batch=2)
    np.testing.assert_array_equal(hf_logits(loaded, toks), hf_logits(reference, toks))
    return model, again, config


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_is_the_same_tensors_and_transformers_loads_it(checkpoints, tmp_path, family):
    path, reference = checkpoints[family]
    assert_export_round_trips(path, reference, tmp_path, family)


def _copy(path, directory, tensors=None, **changes):
    """A copy of checkpoint `path` in `directory`: config.json changed, tensors replaced."""
    directory.mkdir()
    config = json.loads((path / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    if tensors is None:
        (directory / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    else:
        write_safetensors(directory / "model.safetensors", tensors, metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_the_fused_expert_layout_loads(checkpoints, tmp_path, family):
    """transformers 5's in-memory names (`mlp.experts.gate_up_proj [E, 2I, F]`, Mixtral's
    router as `mlp.gate`), read each device's slice only."""
    path, reference = checkpoints[family]
    fused = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    directory = _copy(path, tmp_path / "fused", tensors=fused)
    reads = []
    model, _ = load(directory, "expert2_model4", on_read=reads.append)
    toks = tokens(batch=4)
    ours = np.asarray(model(jnp.asarray(toks, jnp.int32)))
    np.testing.assert_allclose(ours, hf_logits(reference, toks), atol=1e-4, rtol=0)
    _check_reads(model, reads)
    assert any(r.tensor.endswith("experts.gate_up_proj") for r in reads)


def _check_reads(model, reads):
    params = {".".join(map(str, p)): v[...] for p, v in hf._params(_state(model))}
    per_device = hf_reads.bytes_per_device(reads, params)
    assert len(per_device) == 8
    for device, per_parameter in per_device.items():
        assert set(per_parameter) == set(params)
        for name, got in per_parameter.items():
            assert got == hf_reads.shard_bytes(params[name]), (device, name, got)


@pytest.mark.parametrize("mesh_name", ["expert2_model4", "fsdp4_expert2_zero3"])
def test_each_device_reads_its_shard_of_each_expert_parameter(checkpoints, mesh_name):
    reads = []
    model, _ = load(checkpoints["qwen2_moe"][0], mesh_name, on_read=reads.append)
    _check_reads(model, reads)
    gate_up = [r for r in reads if r.parameter.endswith("mlp.gate_up")]
    # one parameter made of two tensors per expert: each reported
    assert {r.tensor.rsplit(".", 2)[-2] for r in gate_up} == {"gate_proj", "up_proj"}
    params = {".".join(map(str, p)): v[...] for p, v in hf._params(_state(model))}
    value = params[next(n for n in params if n.endswith("mlp.gate_up"))]
    assert hf_reads.shard_bytes(value) < value.nbytes  # sharded: each device reads a part


@pytest.mark.parametrize("family, mesh_name", cases([("qwen2_moe", "expert2_model4")]))
def test_greedy_generation_matches_transformers(checkpoints, family, mesh_name):
    path, reference = checkpoint(checkpoints, family, mesh_name)
    model, _ = load(path, mesh_name, AxisType.Auto)
    assert_greedy_generation_matches(model, reference)


@pytest.mark.slow
def test_a_pipeline_of_mixed_dense_and_sparse_blocks_is_refused_by_name(checkpoints):
    mesh, options = make_mesh("pipeline2_expert2_data2")
    with pytest.raises(ValueError, match=r"dense_layers=\(1,\)"):
        hf.load_hf(checkpoints["qwen2_moe"][0], mesh=mesh, **options)


def _config(family, **changes):
    config_cls, extra = FAMILIES[family]
    return {**config_cls(**SIZES, **extra).to_dict(), **changes}


def test_unsupported_fields_are_refused_by_name():
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        hf.spec_from_hf_config(_config("mixtral", router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="attention_bias=True"):
        hf.spec_from_hf_config(_config("qwen3_moe", attention_bias=True))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        hf.spec_from_hf_config(_config("olmoe", hidden_act="gelu"))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        hf.spec_from_hf_config(_config("qwen2_moe", mlp_only_layers=[7]))
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        hf.spec_from_hf_config(_config("qwen2_moe", use_sliding_window=True, sliding_window=8))
    with pytest.raises(ValueError, match="head_dim=4"):
        hf.spec_from_hf_config(_config("olmoe", head_dim=4))
    with pytest.raises(ValueError, match="model_type='deepseek_v3' is not supported"):
        hf.spec_from_hf_config({**_config("mixtral"), "model_type": "deepseek_v3"})
    spec = hf.spec_from_hf_config(_config("qwen2_moe"))
    with pytest.raises(ValueError, match="spec.shared_experts=1 cannot be written as a mixtral"):
        hf.hf_config(spec.replace(qkv_bias=False), model_type="mixtral")
    with pytest.raises(ValueError, match="spec.experts=8 .* cannot be written as a llama"):
        hf.hf_config(spec.replace(qkv_bias=False), model_type="llama")


@pytest.mark.parametrize("what", ["logits", pytest.param("generation", marks=pytest.mark.slow)])
def test_flat_qk_norm_with_the_kv_kernel_replicated(checkpoints, what):
    """OLMoE's k norm over all 4 kv heads on a model axis of 8 (each shard projects them
    all for the norm, then keeps the head its query heads read)."""
    path, reference = checkpoints["olmoe"]
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    model = hf.load_hf(path, mesh=mesh)
    assert not model.blocks.blocks.attention.kv_sharded
    if what == "logits":
        toks = tokens(batch=2, length=16)
        ours = np.asarray(model(jnp.asarray(toks, jnp.int32)))
        np.testing.assert_allclose(ours, hf_logits(reference, toks), atol=1e-4, rtol=0)
        return
    assert_greedy_generation_matches(model, reference, seed=2)


def test_mixed_spec_round_trips_through_the_config():
    config = _config("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[0, 1],
                     num_hidden_layers=6)  # fmt: skip
    spec = hf.spec_from_hf_config(config)
    assert spec.moe_layers == (3, 5) and spec.dense_layers == (1,)
    config = hf.hf_config(spec, model_type="qwen2_moe")
    assert hf.spec_from_hf_config(config) == spec.replace(name="hf")
    # every block in mlp_only_layers: transformers builds a dense model, and so do we
    dense = hf.spec_from_hf_config(_config("qwen2_moe", mlp_only_layers=[0, 1, 2]))
    assert not dense.is_moe and dense.ffn_hidden == SIZES["intermediate_size"]


@pytest.mark.slow
def test_generate_command_line_runs_a_mixture_of_experts(checkpoints, capsys):
    from shardfuse.__main__ import main

    path, reference = checkpoints["olmoe"]
    assert main(["generate", "--model", str(path), "--tokens", "3,1,4,1,5",
                 "--max-new-tokens", "8", "--mesh", "expert=2,model=2"]) == 0  # fmt: skip
    got = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    with torch.no_grad():
        want = reference.generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=8,
                                  do_sample=False, min_new_tokens=8, eos_token_id=None,
                                  pad_token_id=0)[0, 5:].tolist()  # fmt: skip
    assert got == want
