"""The import rules of the package, read from the source with `ast` (nothing is imported).

DESIGN.md: data flows one way, planner -> parallel -> layers -> collectives ->
kernels, all of them reading the data modules at the bottom (model_spec, hardware,
flops, ring_time, axes). These tests build the graph of `import` statements between
the modules of `src/shardfuse` (at any depth: an import inside a function is
an edge too) and check:

- no cycle between modules;
- no import up the layers (kernels imports no collectives, layers, parallel or
  planner; collectives no layers, parallel or planner; layers no parallel or
  planner; parallel no planner; the data modules none of them); `parallel`
  knows nothing of kernels but their varying-axes helpers (`kernels.vma`,
  used at every level, documented in `parallel/__init__.py`);
- no library module imports the applications built on it (the command line,
  `bench`, `demos`, `profile`, the package root);
- no module imports a private module (`_name`) of another package, nor a
  private name (`from a.b import _name`) defined in another package, nor reads
  one as an attribute (`b._name`, `a.b._name`, after `from a import b` or
  `import a.b as b`).

A failure prints every offending edge as `importer:line -> imported`, or the
cycle as a chain of such edges.
"""

import ast
from pathlib import Path

import pytest

from shardfuse import hardware

PACKAGE_DIR = Path(hardware.__file__).resolve().parent
ROOT = "shardfuse"

# The layers, bottom first; a module may import its own layer and those below.
# `models` (the package, and its model `models.transformer`) sits on the layers; the model's
# shape (`model_spec`) is a data module at the bottom, read by `flops` and the cost models.
# `train` (the trainer) sits on the planner: it reads plans, and builds runs with `parallel`.
LAYERS = ("kernels", "collectives", "layers", "models", "parallel", "planner", "train")
DATA_MODULES = ("model_spec", "hardware", "flops", "ring_time", "axes")
# Programs over the library: the library never imports them.
APPLICATIONS = ("__main__", "_info", "bench", "demos", "profile")

# Documented exceptions: (importer prefix, imported prefix, where it is documented).
ALLOWED_UP = ()
PARALLEL_READS_OF_KERNELS = ("shardfuse.kernels.vma",)  # parallel/__init__.py docstring
# (none: parallel reads what it needs of the layers' mesh plumbing from collectives.sharding,
# and tells the layers' own parameters apart by their public `fsdp.ZeroOptions`)
KNOWN_PRIVATE_IMPORTS: set = set()
KNOWN_PRIVATE_NAMES: set = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The module of the package that `name` (a module or a name in one) is, or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: str, path: Path):
    """`(imported module, line)` for every import of a shardfuse module in `module`."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT:
                    yield _resolve(alias.name), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != ROOT:
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                full = f"{source}.{alias.name}"
                yield (full if full in MODULES else _resolve(source)), node.lineno


GRAPH = {
    module: sorted({edge for edge in _edges(module, path) if edge[0]})
    for module, path in MODULES.items()
}


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(PACKAGE_DIR.parent).as_posix()}:{line}"


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _rank(module: str) -> int | None:
    """0 for a data module, 1 + the index in LAYERS for a layer, None for the rest."""
    top = _top(module)
    if module in (f"{ROOT}.{name}" for name in DATA_MODULES):
        return 0
    return LAYERS.index(top) + 1 if top in LAYERS else None


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_is_read():
    """The rules below must not pass because the reader found nothing."""
    assert len(MODULES) > 100
    assert "shardfuse.hardware" in {target for target, _ in GRAPH["shardfuse.flops"]}
    assert "shardfuse.model_spec" in {target for target, _ in GRAPH["shardfuse.flops"]}
    assert any(
        _is_under(target, "shardfuse.collectives")
        for target, _ in GRAPH["shardfuse.layers.attention"]
    )


def find_cycle(graph) -> list | None:
    """One cycle of `graph` (`{node: [(node, line), ...]}`) as `[(node, line), ...]`, or None.

    Example:
      >>> find_cycle({"a": [("b", 1)], "b": [("a", 2)]})
      [('a', 1), ('b', 2)]
      >>> find_cycle({"a": [("b", 1)], "b": []}) is None
      True
    """
    state = {}  # node -> 1 on the current path, 2 done
    path = []  # [(node, line of its edge to the next)]

    def visit(node):
        state[node] = 1
        for target, line in graph.get(node, ()):
            path.append((node, line))
            if state.get(target) == 1:
                start = next(i for i, (n, _) in enumerate(path) if n == target)
                return path[start:]
            if target not in state:
                found = visit(target)
                if found:
                    return found
            path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    if cycle:
        chain = [f"{_where(module, line)} ({module}) ->" for module, line in cycle]
        pytest.fail("import cycle:\n  " + "\n  ".join(chain) + f"\n  {cycle[0][0]}")


def test_the_cycle_finder_finds_a_planted_cycle():
    planted = {m: list(edges) for m, edges in GRAPH.items()}
    planted["shardfuse.kernels.attention.masks"].append(("shardfuse.flops", 1))
    planted["shardfuse.flops"].append(("shardfuse.kernels.attention.masks", 2))
    cycle = find_cycle(planted)
    assert cycle is not None
    assert {module for module, _ in cycle} == {
        "shardfuse.flops",
        "shardfuse.kernels.attention.masks",
    }


def _layering_offences(graph) -> list[str]:
    offences = []
    for module, edges in graph.items():
        rank = _rank(module)
        if rank is None:
            continue
        for target, line in edges:
            target_rank = _rank(target)
            if target_rank is not None and target_rank > rank:
                if any(_is_under(module, a) and _is_under(target, b) for a, b, _ in ALLOWED_UP):
                    continue
                offences.append(f"{_where(module, line)}: {module} -> {target} (up the layers)")
            elif _top(module) == "parallel" and _top(target) == "kernels":
                if not any(_is_under(target, allowed) for allowed in PARALLEL_READS_OF_KERNELS):
                    offences.append(
                        f"{_where(module, line)}: {module} -> {target} (parallel reads of kernels "
                        f"only {PARALLEL_READS_OF_KERNELS})"
                    )
            elif target == ROOT or _top(target) in APPLICATIONS:
                offences.append(f"{_where(module, line)}: {module} -> {target} (an application)")
    return offences


def test_imports_flow_down_the_layers():
    offences = _layering_offences(GRAPH)
    assert not offences, (
        f"imports against the layering {' < '.join(('data', *LAYERS))}:\n" + "\n".join(offences)
    )


def test_the_layering_check_catches_a_planted_edge():
    planted = {m: list(edges) for m, edges in GRAPH.items()}
    planted["shardfuse.kernels.attention.masks"].append(("shardfuse.layers.linear", 7))
    planted["shardfuse.parallel.zero"].append(("shardfuse.kernels.attention.api", 8))
    planted["shardfuse.flops"].append(("shardfuse.demos.tiny_lm", 9))
    # the model's shape is data at the bottom: it reads no package above it, and the data
    # modules read it from below, not through `shardfuse.models` (a layer above them)
    planted["shardfuse.model_spec"].append(("shardfuse.models.transformer", 10))
    planted["shardfuse.flops"].append(("shardfuse.models", 11))
    offences = sorted(set(_layering_offences(planted)) - set(_layering_offences(GRAPH)))
    assert len(offences) == 5, offences
    expected = "masks.py:7: shardfuse.kernels.attention.masks -> shardfuse.layers.linear"
    assert any(expected in offence for offence in offences), offences
    assert any("model_spec.py:10: shardfuse.model_spec -> shardfuse.models" in o for o in offences)
    assert any("flops.py:11: shardfuse.flops -> shardfuse.models " in o for o in offences)


def _private_offences(graph) -> list[str]:
    offences = []
    for module, edges in graph.items():
        for target, line in edges:
            parts = target.split(".")
            private = [i for i, part in enumerate(parts) if part.startswith("_")]
            private = [i for i in private if not parts[i].startswith("__")]
            if not private:
                continue
            owner = ".".join(parts[: private[0]])  # the package the private module belongs to
            if _is_under(module, owner) or (module, target) in KNOWN_PRIVATE_IMPORTS:
                continue
            offences.append(f"{_where(module, line)}: {module} -> {target} (private to {owner})")
    return offences


def test_no_private_module_of_another_package_is_imported():
    offences = _private_offences(GRAPH)
    assert not offences, "private modules imported from outside their package:\n" + "\n".join(
        offences
    )


def test_the_private_check_catches_a_planted_edge():
    planted = {m: list(edges) for m, edges in GRAPH.items()}
    planted["shardfuse.collectives.sharding"].append(("shardfuse.layers._sharding", 3))
    planted["shardfuse.layers.linear"].append(("shardfuse.layers._sharding", 4))  # its own
    planted["shardfuse.kernels.registry"].append(("shardfuse._compat", 5))  # the root's
    offences = sorted(set(_private_offences(planted)) - set(_private_offences(GRAPH)))
    assert len(offences) == 1 and "sharding.py:3" in offences[0], offences


def _private_names():
    """`(importer, line, "defining.module._name")` for every `from m import _name` of a name."""
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module.split(".")[0] != ROOT or node.module not in MODULES:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{node.module}.{alias.name}" not in MODULES:  # a name, not a module
                    yield module, node.lineno, f"{node.module}.{alias.name}"


def _private_name_offences(imports) -> list[str]:
    offences = []
    for module, line, name in imports:
        defining = name.rpartition(".")[0]
        is_package = MODULES[defining].name == "__init__.py"
        owner = defining if is_package else defining.rpartition(".")[0]
        if _is_under(module, owner) or (module, name) in KNOWN_PRIVATE_NAMES:
            continue
        offences.append(f"{_where(module, line)}: {module} imports {name} (private to {owner})")
    return offences


def test_no_private_name_of_another_package_is_imported():
    offences = _private_name_offences(_private_names())
    assert not offences, "private names imported from outside their package:\n" + "\n".join(
        offences
    )


def test_the_private_name_check_catches_a_planted_import():
    planted = [
        ("shardfuse.collectives.ring_attention.ring", 3, "shardfuse.kernels.attention.masks._all"),
        ("shardfuse.kernels.attention.api", 4, "shardfuse.kernels.attention.masks._all"),  # sibling
    ]
    offences = _private_name_offences(planted)
    assert len(offences) == 1 and "ring.py:3" in offences[0], offences


def _module_bindings(module: str, tree) -> dict:
    """Local name -> shardfuse module, for every `import` of a module in `module`'s source."""
    is_package = MODULES.get(module, Path()).name == "__init__.py"
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT and alias.name in MODULES:
                    # `import a.b as c` binds c to a.b; `import a.b` binds a
                    bound[alias.asname or ROOT] = alias.name if alias.asname else ROOT
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    return bound


def private_attribute_reads(module: str, source: str):
    """`(module, line, "defining.module._name")` for every read of `m._name` in `source`,
    where `m` (a name, or a chain `a.b.m` of modules) is a shardfuse module that `module`
    imports: the attribute form of `from m import _name`."""
    tree = ast.parse(source)
    bound = _module_bindings(module, tree)

    def module_of(node):
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = module_of(node.value)
            if base is not None and f"{base}.{node.attr}" in MODULES:
                return f"{base}.{node.attr}"
        return None

    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        base = module_of(node.value)
        if base is not None and f"{base}.{node.attr}" not in MODULES:  # a name, not a module
            yield module, node.lineno, f"{base}.{node.attr}"


def test_no_private_name_of_another_package_is_read_as_an_attribute():
    reads = [
        read
        for module, path in MODULES.items()
        for read in private_attribute_reads(module, path.read_text())
    ]
    offences = _private_name_offences(reads)
    assert not offences, "private names read from outside their package:\n" + "\n".join(offences)


def test_the_private_attribute_check_catches_a_planted_read():
    """The reader on planted source: `module._name` of another package (by `from`-import,
    `import ... as`, and through a chain of modules) is caught; the package's own private
    names, a private module, dunders and attributes of non-modules are not."""
    planted = "\n".join(
        [
            "from shardfuse.kernels.attention import pallas_tpu_kernels as attention",
            "import shardfuse.kernels.attention.base as base",
            "from shardfuse import kernels",
            "from shardfuse.collectives.ring_attention import layouts",
            "from shardfuse.layers import _sharding",
            "attention._dot(1, 2)",  # line 6: another package's private name
            "base._check_window(None)",  # 7
            "kernels.attention.masks._all",  # 8: through a chain of modules
            "layouts._private_helper",  # the importer's own package
            "attention.__name__, kernels.registry.get, _sharding.layer_axes",
            "x = object(); x._y",
        ]
    )
    reads = list(private_attribute_reads("shardfuse.collectives.ring_attention.ring", planted))
    offences = _private_name_offences(reads)
    assert sorted(offence.split(":")[1] for offence in offences) == ["6", "7", "8"], offences
    dot = "pallas_tpu_kernels._dot (private to shardfuse.kernels.attention)"
    assert any(dot in offence for offence in offences), offences
