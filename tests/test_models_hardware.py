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
    assert models.ModelShape("ok", **sizes).heads == 4
    with pytest.raises(ValueError, match="heads=4 must be a multiple of kv_heads=3"):
        models.ModelShape("gqa", **{**sizes, "kv_heads": 3})
    with pytest.raises(ValueError, match="hidden=0"):
        models.ModelShape("zero", **{**sizes, "hidden": 0})


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
        if relative == "__init__.py":
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


@pytest.mark.parametrize("name", ["models.py", "hardware.py"])
def test_data_modules_import_nothing_of_shardfuse_but_each_other(name):
    allowed = {"shardfuse.models", "shardfuse.hardware"}
    for line, module, names in _imports(PACKAGE / name):
        if module == "shardfuse":
            assert names is not None and set(names) <= {"models", "hardware"}, (name, line)
        elif module.startswith("shardfuse."):
            assert module in allowed, f"{name}:{line} imports {module}"
