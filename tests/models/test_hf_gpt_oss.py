"""gpt-oss (Hugging Face `gpt_oss`) in and out, against `transformers` (the oracle).

A tiny random gpt-oss (4 blocks alternating sliding / full attention with a window of 4
keys, 8 experts, top 2, YaRN RoPE with factor 4 over an original length of 16, random
non-zero sinks and biases, weights large enough that the SwiGLU clamp acts) is built with
`transformers` (torch on CPU, no download), saved with `save_pretrained`, and loaded into
shardfuse on the meshes the other mixtures of experts use (`test_hf_moe.MESHES`): logits
within 1e-4 in float32, 32 greedy tokens equal to `generate(do_sample=False)`, the export
bitwise the same tensors (and `from_pretrained` of it the same logits), and the bytes each
device reads. Then each ingredient alone: the sink identity with its gradients against
transformers' eager attention, the YaRN frequencies against `_compute_yarn_parameters`,
the router and clamped experts against `GptOssMLP`, MXFP4 experts against
`convert_moe_packed_tensors`; and the configs refused by name. One mesh each for logits
and generation runs quick, the rest are `slow`.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import shardfuse as sf
from shardfuse.layers.attention import apply_sinks, rope_frequencies
from shardfuse.models import hf, mxfp4
from shardfuse.models.block_runs import block_runs
from shardfuse.models.safetensors import write_safetensors
from tests.models.test_hf import assert_greedy_generation_matches, hf_logits
from tests.models.test_hf_moe import MESHES, _check_reads, _copy, _state, assert_export_round_trips

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

YARN = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=16)  # fmt: skip
CONFIG = dict(
    hidden_size=64,
    intermediate_size=48,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    vocab_size=128,
    num_hidden_layers=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=64,
    rope_parameters=YARN,
)
QUICK_LOGITS = ("expert2_model4",)
QUICK_GENERATION = ("expert4_data2",)
LENGTH = 24  # > the window (4) and the original length (16): both matter


def tokens(batch=8, length=LENGTH, seed=0):
    return np.random.default_rng(seed).integers(0, CONFIG["vocab_size"], (batch, length))


def _randomize(model):
    """Weights N(0, 0.2) (clear argmax margins; the clamp acts); every 1-D parameter (norms,
    biases, sinks) moved by N(0, 0.5), so biases and sinks are non-zero."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.5)


def _build(path, seed, **changes):
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**CONFIG, **changes})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomize(model)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, the transformers model): "alternating" (the default layer
    types), and "sliding" (every block windowed: one kind of block, for the pipeline)."""
    return {
        "alternating": _build(tmp_path_factory.mktemp("gpt_oss"), 30),
        "sliding": _build(
            tmp_path_factory.mktemp("gpt_oss_sliding"), 31, layer_types=["sliding_attention"] * 4
        ),  # fmt: skip
    }


def checkpoint(checkpoints, mesh_name):
    """A pipeline runs one kind of block: the all-sliding model on the pipeline mesh."""
    return checkpoints["sliding" if MESHES[mesh_name][2].get("pipelined") else "alternating"]


def load(path, mesh_name, axis_type=AxisType.Explicit, **extra):
    shape, names, options = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
    return hf.load_hf(path, mesh=mesh, **options, **extra), mesh


def _cases(quick):
    return [pytest.param(m, marks=() if m in quick else pytest.mark.slow) for m in MESHES]


def test_spec_of_the_checkpoint(checkpoints):
    spec = hf.read_hf_spec(checkpoints["alternating"][0])
    assert spec.window == 4 and spec.window_layers == (0, 2)
    assert [spec.layer_window(i) for i in range(4)] == [(3, 0), None, (3, 0), None]
    assert spec.rope_scaling == ("yarn", 4.0, 8.0, 1.0, 16, False, 0.1 * np.log(4.0) + 1)
    assert (spec.attention_sinks, spec.attention_bias, spec.expert_bias) == (True,) * 3
    assert (spec.activation, spec.swiglu_limit, spec.swiglu_alpha) == ("swiglu_clamped", 7.0,
                                                                      1.702)  # fmt: skip
    assert (spec.experts, spec.top_k, spec.expert_hidden, spec.normalize_top_k) == (8, 2, 48, True)
    assert [(r.windowed, r.count) for r in block_runs(spec)] == [(True, 1), (False, 1)] * 2
    sliding = hf.read_hf_spec(checkpoints["sliding"][0])
    assert sliding.window == 4 and sliding.window_layers is None
    # the parameter count is the checkpoint's
    reference = checkpoints["alternating"][1]
    assert spec.num_params() == sum(p.numel() for p in reference.parameters())


@pytest.mark.slow
def test_each_ingredient_changes_the_reference(checkpoints):
    """The test model exercises what it claims: without the window, YaRN, the sinks, the
    biases or the clamp, transformers' own logits move by more than the tolerance x 100."""
    path, reference = checkpoints["alternating"]
    toks = tokens(batch=2)
    want = hf_logits(reference, toks)
    config = reference.config.to_dict()
    variants = dict(
        window=dict(layer_types=["full_attention"] * 4),
        yarn=dict(rope_parameters=dict(rope_type="default", rope_theta=100.0)),
        clamp=dict(swiglu_limit=1e4),
    )
    for name, change in variants.items():
        other = transformers.GptOssConfig(**{**config, **change})
        model = transformers.AutoModelForCausalLM.from_config(other).eval()
        model.load_state_dict(reference.state_dict())
        assert np.abs(hf_logits(model, toks) - want).max() > 1e-2, name
    for suffix in ("sinks", "bias"):  # zeroed in a copy of the model
        model = transformers.AutoModelForCausalLM.from_config(reference.config).eval()
        state = {k: (v * 0 if k.endswith(suffix) else v) for k, v in reference.state_dict().items()}
        model.load_state_dict(state)
        assert np.abs(hf_logits(model, toks) - want).max() > 1e-2, suffix


@pytest.mark.parametrize("mesh_name", _cases(QUICK_LOGITS))
def test_logits_match_transformers(checkpoints, mesh_name):
    path, reference = checkpoint(checkpoints, mesh_name)
    model, _ = load(path, mesh_name)
    toks = tokens()
    ours = np.asarray(model(jnp.asarray(toks, jnp.int32)))
    np.testing.assert_allclose(ours, hf_logits(reference, toks), atol=1e-4, rtol=0)


@pytest.mark.parametrize("mesh_name", _cases(QUICK_GENERATION))
def test_greedy_generation_matches_transformers(checkpoints, mesh_name):
    path, reference = checkpoint(checkpoints, mesh_name)
    model, _ = load(path, mesh_name, AxisType.Auto)
    assert_greedy_generation_matches(model, reference)


def test_export_is_the_same_tensors_and_transformers_loads_it(checkpoints, tmp_path):
    path, reference = checkpoints["alternating"]
    model, again, config = assert_export_round_trips(path, reference, tmp_path, "gpt_oss")
    assert config["layer_types"] == reference.config.layer_types
    assert again.spec == model.spec.replace(name="out")


@pytest.mark.parametrize(
    "mesh_name", ["expert2_model4", pytest.param("fsdp4_expert2_zero3", marks=pytest.mark.slow)]
)
def test_each_device_reads_its_shard_of_each_expert_parameter(checkpoints, mesh_name):
    reads = []
    model, _ = load(checkpoints["alternating"][0], mesh_name, on_read=reads.append)
    _check_reads(model, reads)
    params = {".".join(map(str, p)): v[...] for p, v in hf._params(_state(model))}
    for leaf in ("gate_up", "down", "gate_up_bias", "down_bias"):  # expert-sharded
        name = next(n for n in params if n.endswith(f"mlp.{leaf}"))
        assert sf.models.hf_reads.shard_bytes(params[name]) < params[name].nbytes, name


def test_a_pipeline_of_alternating_windows_is_refused_by_name(checkpoints):
    shape, names, options = MESHES["pipeline2_expert2_data2"]
    mesh = jax.make_mesh(shape, names)
    with pytest.raises(ValueError, match=r"window_layers=\(0, 2\)"):
        hf.load_hf(checkpoints["alternating"][0], mesh=mesh, **options)


# --- the ingredients, each against transformers ---------------------------------------


class _Sinks(torch.nn.Module):
    """What `eager_attention_forward` reads of its module."""

    def __init__(self, sinks, groups):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = groups
        self.training = False


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_identity_and_gradients_equal_transformers_eager_attention(window):
    """`flash_attention(return_lse=True)` then `apply_sinks` equals transformers' softmax
    over the logits and the sink column, forward and the vjp in q, k, v and the sinks."""
    B, T, H, K, D = 2, 9, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(B, T, n, D)).astype(np.float32) for n in (H, K, K))
    sinks = rng.normal(size=(H,)).astype(np.float32) * 2
    ct = rng.normal(size=(B, T, H, D)).astype(np.float32)
    # transformers: [B, heads, T, D], an additive causal (and sliding) mask
    tq, tk, tv, ts = (torch.tensor(a, requires_grad=True) for a in (q, k, v, sinks))
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    mask = torch.tensor(np.where(visible, 0.0, np.finfo(np.float32).min), dtype=torch.float32)
    module = _Sinks(ts, H // K)
    out, _ = modeling_gpt_oss.eager_attention_forward(
        module, tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2), mask[None, None],
        scaling=D**-0.5,
    )  # fmt: skip
    out.backward(torch.tensor(ct))
    window_arg = None if window is None else (window - 1, 0)

    def ours(q, k, v, sinks):
        o, lse = sf.flash_attention(q, k, v, causal=True, window=window_arg, return_lse=True)
        return apply_sinks(o, lse, sinks)

    got, vjp = jax.vjp(ours, *(jnp.asarray(a) for a in (q, k, v, sinks)))
    grads = vjp(jnp.asarray(ct))
    np.testing.assert_allclose(np.asarray(got), out.detach().numpy(), atol=1e-5, rtol=1e-5)
    for name, g, t in zip("qkvs", grads, (tq, tk, tv, module.sinks), strict=True):
        np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), atol=2e-5, rtol=2e-5,
                                   err_msg=name)  # fmt: skip


@pytest.mark.parametrize(
    "rope",
    [
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=4096, rope_theta=150000.0),  # gpt-oss's own
        dict(factor=4.0, beta_fast=8.0, beta_slow=1.0, original_max_position_embeddings=16,
             rope_theta=100.0),  # truncate by default; the test model's
        dict(factor=8.0, mscale=0.7, mscale_all_dim=1.0, original_max_position_embeddings=64,
             rope_theta=10000.0),  # attention factor from mscale (DeepSeek's form)
        dict(factor=2.0, attention_factor=0.5, original_max_position_embeddings=32,
             rope_theta=500.0, beta_fast=None),  # None: transformers' 32
    ],
)  # fmt: skip
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    head_dim = 64 if rope["rope_theta"] == 150000.0 else 16
    config = transformers.GptOssConfig(
        **{**CONFIG, "head_dim": head_dim, "rope_parameters": dict(rope_type="yarn", **rope)}
    )
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    spec = hf.spec_from_hf_config(config.to_dict())
    ours = rope_frequencies(head_dim, spec.rope_theta, spec.rope_scaling)
    np.testing.assert_allclose(np.asarray(ours), inv_freq.numpy(), rtol=1e-6, atol=0)
    assert spec.rope_scaling[-1] == pytest.approx(attention_factor, rel=1e-12)


def test_router_and_clamped_experts_equal_transformers_gpt_oss_mlp():
    """`ParallelMoE(expert_bias=True, activation="swiglu_clamped")` on an expert x model mesh
    equals `GptOssMLP` (biased router, softmax over the top-k logits, the clamped SwiGLU with
    the interleaved gate/up layout and biases); inputs large enough that both clamps act."""
    config = transformers.GptOssConfig(**CONFIG)
    torch.manual_seed(1)
    reference = modeling_gpt_oss.GptOssMLP(config).eval()
    _randomize(reference)
    F, E = config.hidden_size, config.num_local_experts
    x = torch.randn(2, 8, F) * 3
    with torch.no_grad():
        want = reference(x)[0].numpy()
        gate_up = torch.einsum("bf,efc->bec", x.reshape(-1, F), reference.experts.gate_up_proj)
        gate_up = gate_up + reference.experts.gate_up_proj_bias
    assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()  # clamps act
    mesh = jax.make_mesh((2, 2), ("expert", "model"))
    moe = sf.layers.ParallelMoE(F, config.intermediate_size, num_experts=E, top_k=2,
                                activation="swiglu_clamped", expert_bias=True, mesh=mesh,
                                rngs=nnx.Rngs(0))  # fmt: skip
    weights = dict(
        router=reference.router.weight.T, router_bias=reference.router.bias,
        gate_up=reference.experts.gate_up_proj, gate_up_bias=reference.experts.gate_up_proj_bias,
        down=reference.experts.down_proj, down_bias=reference.experts.down_proj_bias,
    )  # fmt: skip
    for name, value in weights.items():
        variable = getattr(moe, name)
        variable[...] = jax.device_put(value.detach().numpy(), variable[...].sharding)
    got = np.asarray(moe(jnp.asarray(x.numpy())))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


def test_llama_with_yarn_rope_matches_transformers(tmp_path):
    """YaRN in a dense family too (the frequencies and cos/sin scaling are shared)."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      vocab_size=128, head_dim=8, max_position_embeddings=64,
                                      rope_parameters=YARN)  # fmt: skip
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomize(reference)
    reference.save_pretrained(tmp_path)
    model = hf.load_hf(tmp_path, mesh=jax.make_mesh((2, 4), ("data", "model")))
    assert model.spec.rope_scaling[0] == "yarn"
    toks = tokens()
    ours = np.asarray(model(jnp.asarray(toks, jnp.int32)))
    np.testing.assert_allclose(ours, hf_logits(reference, toks), atol=1e-4, rtol=0)


# --- refused by name ------------------------------------------------------------------


def _config(**changes):
    return {**transformers.GptOssConfig(**CONFIG).to_dict(), **changes}


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(layer_types=["sliding_attention"] * 3), "layer_types="),
        (dict(layer_types=["chunked_attention"] * 4), "layer_types="),
        (dict(sliding_window=None), "sliding_window=None"),
        (dict(attention_dropout=0.1), "attention_dropout=0.1"),
        (dict(quantization_config=dict(quant_method="fp8")), "quantization_config="),
        (dict(rope_parameters=dict(YARN, partial_rotary_factor=0.5)), "partial_rotary_factor"),
        (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1.0)), "'longrope'"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        hf.spec_from_hf_config(_config(**changes))


def test_config_defaults_are_gpt_oss_configs():
    """Fields config.json omits take `GptOssConfig`'s defaults (theta 150000, YaRN x32,
    window 128 on the even blocks, eps 1e-5, attention biases)."""
    config = {k: v for k, v in _config().items() if k in
              ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
               "num_local_experts", "num_experts_per_tok")}  # fmt: skip
    spec = hf.spec_from_hf_config(config)
    want = transformers.GptOssConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert spec == hf.spec_from_hf_config(want.to_dict())
    assert (spec.rope_theta, spec.rope_scaling[:5], spec.window, spec.window_layers) == (
        150000.0, ("yarn", 32.0, 32.0, 1.0, 4096), 128, (0, 2))  # fmt: skip
    assert spec.norm_eps == 1e-5 and spec.attention_bias


def test_bad_specs_and_exports_are_refused_by_name():
    spec = hf.spec_from_hf_config(_config())
    with pytest.raises(ValueError, match="activation='swiglu_clamped' cannot be written as a"):
        hf.hf_config(spec, model_type="mixtral")
    with pytest.raises(ValueError, match="window_layers=.* needs model_type='gpt_oss'"):
        hf.hf_config(spec.replace(activation="swiglu"), model_type="mixtral")
    with pytest.raises(ValueError, match="attention_sinks=True cannot be written as a mixtral"):
        hf.hf_config(spec.replace(activation="swiglu", window_layers=None), model_type="mixtral")
    plain = spec.replace(window_layers=None, attention_sinks=False)
    with pytest.raises(ValueError, match="attention_sinks=False cannot be written as a gpt_oss"):
        hf.hf_config(plain, model_type="gpt_oss")
    with pytest.raises(ValueError, match="window_layers=.*sorted tuple"):
        spec.replace(window_layers=(2, 0))
    with pytest.raises(ValueError, match="window_layers=.*window=None"):
        spec.replace(window=None)
    with pytest.raises(ValueError, match="rope_scaling=.*'yarn'"):
        spec.replace(rope_scaling=("yarn", 4.0))
    with pytest.raises(ValueError, match="truncate=1"):
        spec.replace(rope_scaling=("yarn", 4.0, 32.0, 1.0, 16, 1, 1.0))
    with pytest.raises(ValueError, match="swiglu_limit=0"):
        spec.replace(swiglu_limit=0)
    with pytest.raises(ValueError, match="expert_bias=True needs a mixture of experts"):
        sf.models.ModelSpec.tiny(expert_bias=True)
    with pytest.raises(ValueError, match="activation='gelu'"):
        sf.layers.ParallelMoE(8, 8, num_experts=2, top_k=1, activation="gelu",
                              mesh=jax.make_mesh((1,), ("expert",)), rngs=nnx.Rngs(0))  # fmt: skip


@pytest.mark.slow
def test_the_window_and_yarn_are_computed(checkpoints, tmp_path):
    """Loaded with the window removed (every layer full) or YaRN removed from config.json,
    our logits leave transformers' by far more than the tolerance: both are computed."""
    path, reference = checkpoints["alternating"]
    toks = tokens()
    want = hf_logits(reference, toks)
    for i, change in enumerate(
        [dict(layer_types=["full_attention"] * 4), dict(rope_parameters=dict(rope_type="default",
                                                                           rope_theta=100.0))]
    ):  # fmt: skip
        changed = _copy(path, tmp_path / str(i), **change)
        model, _ = load(changed, "expert2_model4")
        ours = np.asarray(model(jnp.asarray(toks, jnp.int32)))
        assert np.abs(ours - want).max() > 1e-2, change


# --- MXFP4 checkpoints (the hub's form of gpt-oss's experts) ----------------------------


def _quantize_mxfp4(w):
    """MXFP4 `(blocks, scales)` of `w` `[..., rows, cols]` (cols a multiple of 32): per group
    of 32 the smallest power-of-two scale that fits its largest value in FP4's 6, each
    value rounded to the nearest FP4 code (a test's quantizer: any codes test the reader)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    top = np.abs(groups).max(-1, keepdims=True)
    exponent = np.ceil(np.log2(np.maximum(top, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.exp2(exponent)
    codes = np.abs(scaled[..., None] - mxfp4.FP4_VALUES).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent[..., 0] + 127).astype(np.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """`(directory, transformers model holding the dequantized experts, {tensor: (blocks,
    scales)})`: a 2-block gpt-oss (both sliding: one Stack) of experts 64 wide (MXFP4 groups
    of 32) with its expert
    weights stored as `_blocks` and `_scales`, and `quantization_config` saying so."""
    path, model = _build(tmp_path_factory.mktemp("gpt_oss_mxfp4"), 32, intermediate_size=64,
                         num_hidden_layers=2, layer_types=["sliding_attention"] * 2)  # fmt: skip
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    packed = {}
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        packed[name] = _quantize_mxfp4(np.swapaxes(state.pop(name), 1, 2))  # [E, out, in]
        state[name + "_blocks"], state[name + "_scales"] = packed[name]
    write_safetensors(path / "model.safetensors", state, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="mxfp4", modules_to_not_convert=[
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"])  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():  # the dense reference: transformers' own dequantization
        for name, (blocks, scales) in packed.items():
            weight = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                dtype=torch.float32)  # fmt: skip
            model.get_parameter(name).copy_(weight)
    return path, model, packed


def test_mxfp4_dequantization_equals_transformers():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 5, 2), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                      dtype=torch.float32)  # fmt: skip
    ours = np.swapaxes(mxfp4.dequantize(blocks, scales), 1, 2)  # [E, in, out], as theirs
    np.testing.assert_array_equal(ours, want.numpy())
    with pytest.raises(ValueError, match="MXFP4 blocks of shape"):
        mxfp4.dequantize(blocks[..., :8], scales)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_mxfp4_checkpoint_loads_each_devices_bytes_dequantized(mxfp4_checkpoint, param_dtype):
    """Each device reads its experts' and its columns' packed bytes (half a byte a value and
    a scale byte per 32) and holds transformers' dequantization bitwise, in the parameter
    dtype; the logits (float32) are transformers' with those weights."""
    path, reference, packed = mxfp4_checkpoint
    mesh = jax.make_mesh((2, 2, 2), ("expert", "data", "model"))
    reads = []
    dtype = jnp.dtype(param_dtype)
    model = hf.load_hf(path, mesh=mesh, param_dtype=dtype, on_read=reads.append)
    params = {".".join(map(str, p)): v[...] for p, v in hf._params(_state(model))}
    for tensor, (blocks, scales) in packed.items():
        layer = int(tensor.split(".")[2])
        leaf = "mlp.gate_up" if "gate_up" in tensor else "mlp.down"
        ours = next(v for n, v in params.items() if n.endswith(leaf))[layer]  # (one Stack)
        torch_dtype = torch.float32 if param_dtype == "float32" else torch.bfloat16
        want = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                          dtype=torch_dtype).float().numpy()  # fmt: skip
        np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), want)
    per_device = sf.models.hf_reads.bytes_per_device(reads, params)
    for device, per_parameter in per_device.items():
        for name, got in per_parameter.items():
            value = params[name]
            if name.endswith(("mlp.gate_up", "mlp.down")):  # packed: 1/2 + 1/32 byte a value
                elements = sf.models.hf_reads.shard_bytes(value, itemsize=1)
                assert got == elements // 2 + elements // 32, (device, name, got)
            else:
                assert got == sf.models.hf_reads.shard_bytes(value, itemsize=4), (device, name)
    if param_dtype == "float32":
        toks = tokens()
        ours = np.asarray(model(jnp.asarray(toks, jnp.int32)))
        np.testing.assert_allclose(ours, hf_logits(reference, toks), atol=1e-4, rtol=0)
