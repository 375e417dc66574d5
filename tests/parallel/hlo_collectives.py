"""Counting collectives in compiled HLO, per mesh axis, dynamically (loops count their trips).

`count(hlo_text, mesh)` returns a Counter keyed by `(kind, axes)`: kind one
of "all-reduce", "reduce-scatter", "all-gather", "collective-permute",
"all-to-all"; axes the sorted tuple of mesh axes its replica groups span.
An op inside a `while` body counts `known_trip_count` times (a `lax.scan`
over M microbatches: M times), nested loops multiply.
"""

import collections
import itertools
import re

import numpy as np

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
_OP = re.compile(
    r"=\s.*?\s(all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all|while|call|"
    r"conditional|fusion|async-start)(?:-start)?\("
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _computations(text: str) -> dict:
    comps, name, entry = {}, None, None
    for line in text.splitlines():
        if name is None:
            match = _HEADER.match(line)
            if match and ("->" in line or line.startswith("ENTRY")):
                name = match.group(1)
                comps[name] = []
                if line.startswith("ENTRY"):
                    entry = name
            continue
        if line.startswith("}"):
            name = None
            continue
        comps[name].append(line)
    return comps, entry


def _iota_groups(spec: str):
    """Expands `[G,S]<=[d0,d1,...]T(p...)` replica groups."""
    match = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    groups, size = int(match.group(1)), int(match.group(2))
    dims = [int(d) for d in match.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if match.group(4):
        ids = ids.transpose([int(p) for p in match.group(4).split(",")])
    return [tuple(row) for row in ids.reshape(groups, size)]


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?\s*\{([^}]*)\}"
)


def _mesh_axes_groups(match):
    """Expands `mesh['a'=2,'b'=4] {'b'}` replica groups (the form newer XLA prints).

    The mesh is printed with its axis names and sizes, then `device_ids=(...)` when its
    devices are not in iota order, then the axes each group spans; a sub-axis reads
    `name:(pre)size` (Shardy's notation: the axis's devices split major to minor into
    `pre`, `size` and the rest).
    """

    def unquote(text):
        return text.strip().replace("'", "").replace('"', "")

    names, sizes = [], []
    for item in match.group(1).split(","):
        name, size = item.rsplit("=", 1)
        names.append(unquote(name))
        sizes.append(int(size))
    refs = [unquote(r) for r in match.group(3).split(",") if r.strip()]
    ids = np.arange(int(np.prod(sizes)))
    if match.group(2):
        ids = np.array([int(d) for d in re.findall(r"\d+", match.group(2))])
    shape, where = [], {}
    for name, size in zip(names, sizes, strict=True):
        if name in refs:
            where[name] = len(shape)
            shape.append(size)
            continue
        subs = sorted(
            (int(m.group(1)), int(m.group(2)), ref)
            for ref in refs
            if (m := re.fullmatch(re.escape(name) + r":\((\d+)\)(\d+)", ref))
        )
        done = 1
        for pre, part, ref in subs:
            if pre > done:
                shape.append(pre // done)
            where[ref] = len(shape)
            shape.append(part)
            done = pre * part
        shape.append(size // done)
    grouped = [where[r] for r in refs]
    others = [d for d in range(len(shape)) if d not in grouped]
    rows = np.transpose(ids.reshape(shape), others + grouped)
    rows = rows.reshape(-1, int(np.prod([shape[d] for d in grouped])))
    return [tuple(row.tolist()) for row in rows]


def _groups(line: str):
    mesh_groups = _MESH_GROUPS.search(line)
    if mesh_groups is not None:
        return _mesh_axes_groups(mesh_groups)
    match = re.search(
        r"replica_groups=(\{\{[\d,{} ]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line
    )
    if match is None:
        pairs = re.search(r"source_target_pairs=\{([\d,{} ]*)\}", line)
        if pairs is None:
            return None
        edges = [
            tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)\}", pairs.group(0))
        ]
        return ("pairs", edges)
    text = match.group(1)
    if text.startswith("{"):
        return [tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", text)]
    return _iota_groups(text)


def axes_of_groups(groups, mesh) -> tuple:
    """The mesh axes whose device groups equal `groups` (ids); () if none match."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    names = mesh.axis_names
    if isinstance(groups, tuple) and groups and groups[0] == "pairs":
        moved = set()
        for src, dst in groups[1]:
            a, b = np.argwhere(ids == src)[0], np.argwhere(ids == dst)[0]
            moved |= {names[i] for i in range(len(names)) if a[i] != b[i]}
        return tuple(sorted(moved))
    want = {frozenset(g) for g in groups}
    for r in range(1, len(names) + 1):
        for axes in itertools.combinations(range(len(names)), r):
            others = [i for i in range(len(names)) if i not in axes]
            moved = np.transpose(ids, others + list(axes)).reshape(
                -1, int(np.prod([ids.shape[i] for i in axes]))
            )
            if {frozenset(row.tolist()) for row in moved} == want:
                return tuple(sorted(names[i] for i in axes))
    return ()


def _scalar(line: str) -> bool:
    """True when every result of the instruction is a scalar (a loss or token count)."""
    result = line.split("=", 1)[1].split(_OP.search(line).group(1), 1)[0]
    shapes = re.findall(r"\w+\[([\d,]*)\]", result)
    return bool(shapes) and all(s == "" for s in shapes)


def count(text: str, mesh, *, scalars: bool = True) -> collections.Counter:
    """Dynamic counts of collectives by `(kind, axes)` (see the module docstring).

    `scalars=False` leaves out collectives of scalars only (a loss, a token count).
    """
    comps, entry = _computations(text)
    memo = {}

    def visit(name):
        if name in memo:
            return memo[name]
        memo[name] = collections.Counter()  # recursion guard
        total = collections.Counter()
        for line in comps.get(name, ()):
            match = _OP.search(line)
            if match is None:
                continue
            kind = match.group(1)
            if kind in KINDS:
                if not scalars and _scalar(line):
                    continue
                groups = _groups(line)
                total[(kind, axes_of_groups(groups, mesh) if groups else ())] += 1
            elif kind == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                n = int(trips.group(1)) if trips else 1
                for key, value in visit(body).items():
                    total[key] += n * value
            else:
                for callee in re.findall(
                    r"(?:to_apply|calls|branch_computations)=\{?%?([\w.\-]+)", line
                ):
                    total.update(visit(callee))
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                if branches:
                    for callee in re.findall(r"%?([\w.\-]+)", branches.group(1))[1:]:
                        total.update(visit(callee))
        memo[name] = total
        return total

    return visit(entry)


def total(counts, kind, axis) -> int:
    """How many `kind` collectives span mesh axis `axis` (alone or with others)."""
    return sum(n for (k, axes), n in counts.items() if k == kind and axis in axes)
