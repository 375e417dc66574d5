"""The data modules at the bottom of the package, and the rule that keeps them there.

`shardfuse.models` and `shardfuse.hardware` hold the figures that the bench
harness, the cost models and the planner read. Imports flow down: no module
of the package imports the package root, `bench` is imported only by the
command line and the demos, and the data modules import nothing of shardfuse
but each other.
"""

import ast
import math
from pathlib import Path

import pytest

from shardfuse import hardware, models
from shardfuse.planner import published as published_runs

PACKAGE = Path(hardware.__file__).resolve().parent


# ---- models -----------------------------------------------------------------


def test_model_lookup_and_published_figures():
    llama = models.get("llama3-8b")
    assert (llama.hidden, llama.heads, llama.kv_heads, llama.head_dim) == (4096, 32, 8, 128)
    assert (llama.ffn_hidden, llama.num_layers, llama.vocab_size) == (14336, 32, 128256)
    assert models.get("llama3-70b").heads == 64
    assert models.get("llama3-405b").hidden == 16384
    gemma2 = models.get("gemma2-9b")
    assert (gemma2.head_dim, gemma2.window, gemma2.logit_softcap) == (256, 4096, 50.0)
    assert models.get("mistral-7b").causal_mask == ((4095, 0), "causal window=4096")
    assert models.get("llama3-8b").causal_mask == (None, "causal")
    assert models.names() == sorted(models.MODELS)
    assert {"llama3-8b", "llama3-70b", "mistral-7b", "gemma-7b", "gemma2-9b"} <= set(models.names())


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_every_model_is_consistent(name):
    model = models.get(name)
    assert model.name == name
    for value in (model.hidden, model.heads, model.kv_heads, model.head_dim, model.ffn_hidden,
                  model.num_layers, model.vocab_size):  # fmt: skip
        assert isinstance(value, int) and value > 0
    assert model.heads % model.kv_heads == 0
    assert model.window is None or model.window > 0
    assert model.logit_softcap is None or model.logit_softcap > 0


@pytest.mark.parametrize("name", ["llama-3-8b", "", None])
def test_unknown_model_lists_the_valid_names(name):
    with pytest.raises(ValueError, match="is not one of .*llama3-8b"):
        models.get(name)


def test_model_shape_rejects_bad_sizes():
    sizes = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=256, num_layers=2,
                 vocab_size=100)  # fmt: skip
    assert models.ModelSpec("ok", **sizes).heads == 4
    with pytest.raises(ValueError, match="heads=4 must be a multiple of kv_heads=3"):
        models.ModelSpec("gqa", **{**sizes, "kv_heads": 3})
    with pytest.raises(ValueError, match="hidden=0"):
        models.ModelSpec("zero", **{**sizes, "hidden": 0})


# ---- hardware ---------------------------------------------------------------


@pytest.mark.parametrize(
    "device_kind, name, bf16, hbm",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 3350.0),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 2000.0),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5, 3900.0),
        ("NVIDIA H200", "H200 SXM", 989.4, 4800.0),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 312.0, 2039.0),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 312.0, 1935.0),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0, 1555.0),
        ("TPU v4", "TPU v4", 275.0, 1200.0),
        ("TPU v5 lite", "TPU v5e", 197.0, 819.0),
        ("TPU v5e", "TPU v5e", 197.0, 819.0),
        ("TPU v5", "TPU v5p", 459.0, 2765.0),
        ("TPU v5p", "TPU v5p", 459.0, 2765.0),
        ("TPU v6 lite", "TPU v6e", 918.0, 1640.0),
    ],
)
def test_device_kinds_map_to_their_figures(device_kind, name, bf16, hbm):
    chip = hardware.detect(device_kind)
    assert chip is not None and chip.name == name
    assert chip.peak_tflops("bfloat16") == bf16
    assert chip.hbm_gb_per_s == hbm
    assert hardware.device(chip.key) is chip


def test_float32_peaks_links_and_unknown_devices():
    assert hardware.device("h100-sxm").peak_tflops("float32") == 66.9
    assert hardware.device("a100-40gb").peak_tflops("float16") == 312.0
    assert hardware.device("tpu-v5e").peak_tflops("float32") is None
    h100, v5p = hardware.device("h100-sxm"), hardware.device("tpu-v5p")
    assert (h100.link.gb_per_s, h100.link.egress_gb_per_s) == (450.0, 450.0)  # via NVSwitch
    assert (v5p.link.gb_per_s, v5p.link.egress_gb_per_s) == (100.0, 600.0)  # 6 torus links
    for kind in ("cpu", "TFRT_CPU_0", "NVIDIA GeForce RTX 4090", "TPU v4 lite"):
        assert hardware.detect(kind) is None


@pytest.mark.parametrize("key", sorted(hardware.DEVICES))
def test_every_figure_is_positive(key):
    chip = hardware.device(key)
    assert chip.key == key
    assert chip.peak_tflops("bfloat16") > 0
    fp32 = chip.peak_tflops("float32")
    assert fp32 is None or 0 < fp32 < chip.peak_tflops("bfloat16")
    assert chip.hbm_gb > 0 and chip.hbm_gb_per_s > 0
    if chip.link is not None:
        assert 0 < chip.link.gb_per_s <= chip.link.egress_gb_per_s
    assert all(math.isfinite(v) for v in chip.tflops.values() if v is not None)


def test_unknown_device_lists_the_valid_names():
    with pytest.raises(ValueError, match="'h1000' is not one of .*h100-sxm"):
        hardware.device("h1000")


def test_current_device_on_this_host():
    import jax

    expected = hardware.detect(jax.devices()[0].device_kind)
    assert hardware.current_device() is expected


# ---- the import direction ---------------------------------------------------


def _imports(path: Path):
    """`(line, module, names)` of every import statement in `path` (names: None for `import`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def _is_submodule(name: str) -> bool:
    return (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name / "__init__.py").is_file()


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path


def test_no_module_imports_the_package_root():
    """`import shardfuse` or `from shardfuse import <a name of __init__>` makes a module
    depend on everything the root re-exports (and on import order): import the
    submodule that defines the name instead."""
    offences = []
    for relative, path in _modules():
        # The benchmark suites and tools are programs over the public API, as a user writes them.
        if relative == "__init__.py" or relative.startswith(("bench/suites/", "bench/tools/")):
            continue
        for line, module, names in _imports(path):
            if names is None and module == "shardfuse":
                offences.append(f"{relative}:{line}: import shardfuse")
            elif module == "shardfuse":
                roots = [n for n in names if not _is_submodule(n)]
                if roots:
                    offences.append(f"{relative}:{line}: from shardfuse import {', '.join(roots)}")
    assert not offences, "modules that import the package root:\n" + "\n".join(offences)


def test_only_the_command_line_and_demos_import_bench():
    allowed = ("bench/", "demos/", "__main__.py")
    offences = []
    for relative, path in _modules():
        if relative.startswith(allowed):
            continue
        for line, module, names in _imports(path):
            if module == "shardfuse.bench" or module.startswith("shardfuse.bench."):
                offences.append(f"{relative}:{line}: {module}")
            elif module == "shardfuse" and names and "bench" in names:
                offences.append(f"{relative}:{line}: from shardfuse import bench")
    assert not offences, "library modules that import the bench harness:\n" + "\n".join(offences)


# The data modules at the bottom: each imports nothing of shardfuse but the others.
DATA_MODULES = {
    "model_spec.py": "shardfuse.model_spec",
    "hardware.py": "shardfuse.hardware",
    "flops.py": "shardfuse.flops",
    "ring_time.py": "shardfuse.ring_time",
    "axes.py": "shardfuse.axes",
}


@pytest.mark.parametrize("name", sorted(DATA_MODULES))
def test_data_modules_import_nothing_of_shardfuse_but_each_other(name):
    allowed = set(DATA_MODULES.values()) - {DATA_MODULES[name]}
    short = {m.removeprefix("shardfuse.") for m in allowed}
    for line, module, names in _imports(PACKAGE / name):
        if module == "shardfuse":
            assert names is not None and set(names) <= short, (name, line, names)
        elif module.startswith("shardfuse"):
            assert module in allowed, f"{name}:{line} imports {module}"


def test_models_package_reexports_the_shape_and_the_model():
    """`shardfuse.models` re-exports the model's shape from the bottom of the package
    (`shardfuse.model_spec`) and imports its model eagerly: no lazy-import hook; the old
    name of the shape class is a deprecated alias that nothing of the library uses."""
    from shardfuse import model_spec
    from shardfuse.models import transformer

    assert models.ModelSpec is model_spec.ModelSpec and models.get is model_spec.get
    assert models.Transformer is transformer.Transformer
    assert models.LMHead is transformer.LMHead
    with pytest.warns(
        DeprecationWarning, match="sf.models.ModelShape is deprecated .*: use sf.models.ModelSpec"
    ):
        assert models.ModelShape is model_spec.ModelSpec
    with pytest.raises(AttributeError, match="no attribute 'Transformr'"):
        models.Transformr  # noqa: B018
    users = [relative for relative, path in _modules() if "ModelShape" in path.read_text()]
    assert users == ["models/__init__.py"], users


# ---- GPT families, published runs, custom specs --------------------------------


def test_gpt3_and_narayanan_table1_models():
    gpt3 = models.get("gpt3-175b")
    assert (gpt3.hidden, gpt3.heads, gpt3.num_layers, gpt3.ffn_hidden) == (12288, 96, 96, 49152)
    assert gpt3.activation == "gelu" and gpt3.tied_embeddings
    assert abs(gpt3.num_params() / 1e9 - 175) < 1
    # Narayanan et al. 2021 Table 1's "number of parameters (billion)" column.
    published = {"gpt-1.7b": 1.7, "gpt-3.6b": 3.6, "gpt-7.5b": 7.5, "gpt-18b": 18.4,
                 "gpt-39b": 39.1, "gpt-76b": 76.1, "gpt-145b": 145.6, "gpt-310b": 310.1,
                 "gpt-530b": 529.6, "gpt-1t": 1008.0}  # fmt: skip
    for run in published_runs.NARAYANAN_2021_TABLE1:
        model = models.get(run.model)
        assert run.tensor * run.pipeline * run.data == run.gpus
        assert run.global_batch % run.data == 0 and model.num_layers % run.pipeline == 0
        assert model.heads % run.tensor == 0
        # the table rounds to 0.1B and counts biases and position embeddings we leave out
        assert abs(model.num_params() / 1e9 / published[run.model] - 1) < 0.035, run.model
    assert [r.gpus for r in published_runs.NARAYANAN_2021_TABLE1][-1] == 3072


def test_layer_params_match_the_published_counts():
    assert models.get("llama3-8b").num_params() == pytest.approx(8.03e9, rel=2e-3)
    assert models.get("llama3-70b").num_params() == pytest.approx(70.6e9, rel=2e-3)
    assert models.get("llama3-405b").num_params() == pytest.approx(405.9e9, rel=3e-3)
    # a GPT layer is 12 h^2 matmul weights plus two norms
    gpt = models.get("gpt-1.7b")
    assert gpt.layer_params() == 12 * 2304**2 + 2 * 2304 and gpt.mlp_matrices == 2


def test_model_spec_is_user_constructible_and_checked():
    spec = models.ModelSpec("mine", hidden=64, heads=4, kv_heads=1, head_dim=16,
                            ffn_hidden=128, num_layers=3, vocab_size=50)  # fmt: skip
    assert spec.num_params() == 3 * spec.layer_params() + 2 * 50 * 64 + 64
    assert models.ModelSpec.gpt("g", 768, 12, 12).head_dim == 64
    with pytest.raises(ValueError, match="activation='relu' must be one of"):
        models.ModelSpec("bad", 64, 4, 4, 16, 128, num_layers=1, vocab_size=5, activation="relu")
    with pytest.raises(ValueError, match="hidden=100 must be a multiple of heads=3"):
        models.ModelSpec.gpt("bad", 100, 3, 2)


# ---- links and clusters -------------------------------------------------------


def test_tpu_links_are_filled_in():
    assert hardware.device("tpu-v4").link.egress_gb_per_s == 300.0  # 6 links x 50 GB/s
    assert hardware.device("tpu-v6e").link.egress_gb_per_s == 400.0  # 800 both ways
    assert hardware.device("tpu-v6e").link.gb_per_s == 100.0  # over 4 ports


def test_clusters():
    c = hardware.cluster("h100", nodes=8)
    assert (c.num_devices, c.devices_per_node, c.device.key) == (64, 8, "h100-sxm")
    assert (c.intra_link.name, c.inter_link.gb_per_s) == ("NVLink 4", 50.0)
    assert hardware.cluster("a100", nodes=4).inter_link.gb_per_s == 25.0  # HDR, Selene
    assert hardware.cluster("tpu-v5p").devices_per_node == 8960
    assert hardware.cluster("v5e", devices_per_node=64).inter_link.name == "DCN"
    assert hardware.resolve("H100").key == "h100-sxm"
    assert "8 x 8 H100 SXM" in c.describe()
    with pytest.raises(ValueError, match="nodes=0 must be a positive int"):
        hardware.cluster("h100", nodes=0)
    with pytest.raises(ValueError, match="'b200' is not one of .*h100"):
        hardware.cluster("b200")
