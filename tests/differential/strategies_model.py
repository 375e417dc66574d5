"""Hypothesis strategies over the option space of `sf.layers` and `sf.parallel.Pipeline`.

Every strategy draws a plain, hashable description (`LayerCase`, `PipelineCase`); the
tests build the modules from it. Draws are mostly valid: shapes and sizes are picked so that
every divisibility rule holds. About one draw in ten carries a `refusal`: one argument
changed to a value the API must refuse, with the text the error must contain (the argument's
name), so that "a configuration the API refuses raises a clear error" is tested on the same
stream of configurations.

Glossary: B batch, T sequence length, F features, H query heads, K kv heads, D head dim,
L layers, p pipeline stages, m microbatches, v virtual stages (model chunks per stage).
"""

import dataclasses

from hypothesis import strategies as st

LAYER_KINDS = ("column", "row", "mlp", "attention", "block", "norm", "stack")
LAYER_AXES = ("data", "fsdp", "sequence", "model")  # outermost to innermost
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
REMAT = ("none", "full", "selective", "dots", "offload")
PIPELINE_MESHES = {
    "pipeline": ("pipeline",),
    "pipeline-model": ("pipeline", "model"),
    "pipeline-data": ("data", "pipeline"),
    "pipeline-sequence-model": ("pipeline", "sequence", "model"),
}


def frozen(mapping: dict) -> tuple:
    """A dict as a sorted tuple of items (hashable; `dict(...)` gives it back)."""
    return tuple(sorted(mapping.items()))


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One drawn layer configuration.

    Attributes:
      kind: one of `LAYER_KINDS`.
      mesh: `((axis, size), ...)`, outermost first.
      explicit: Explicit (True) or Auto mesh axis types.
      jit: the forward and gradient under `nnx.jit` (True) or eagerly.
      shape: `(B, T, F)` of the input.
      options: constructor keywords of the layer (for "stack": of its blocks).
      block: "stack" only: the stacked block kind ("mlp" or "block").
      stack: "stack" only: `Stack` keywords (num_layers, layer_axis, remat, prefetch).
      call: `(segments, positions)`: attention and block calls with segment ids and with
        RoPE positions that restart (packed sequences).
      input_dtype: dtype name of the input `x`: float32, or for a Stack of bfloat16 blocks
        float32 or bfloat16 (a refusal may make it an integer).
      refusal: None, or `(what, match)`: the perturbation applied and the text the
        ValueError/TypeError must contain.
    """

    kind: str
    mesh: tuple
    explicit: bool
    jit: bool
    shape: tuple
    options: tuple
    block: str | None = None
    stack: tuple = ()
    call: tuple = (False, False)
    input_dtype: str = "float32"
    refusal: tuple | None = None

    @property
    def axes(self) -> dict:
        return dict(self.mesh)

    def size(self, axis) -> int:
        return 1 if axis is None else self.axes.get(axis, 1)


@st.composite
def meshes(draw, axes=LAYER_AXES, *, required=(), max_devices=8):
    """`((axis, size), ...)`: 1-3 axes of `axes` (always those in `required`), sizes in
    {1, 2, 4}, at most `max_devices` devices, in the order of `axes`."""
    optional = [a for a in axes if a not in required]
    count = draw(st.integers(max(1, len(required)), min(3, len(axes))))
    chosen = set(required) | set(draw(st.permutations(optional))[: max(0, count - len(required))])
    mesh, devices = [], 1
    for axis in axes:
        if axis not in chosen:
            continue
        sizes = [s for s in (2, 4, 1) if devices * s <= max_devices]
        size = draw(st.sampled_from(sizes))
        devices *= size
        mesh.append((axis, size))
    return tuple(mesh)


def one_in(n: int):
    """True with probability 1/n. (Not `integers(0, n - 1) == 0`: hypothesis favours the
    bounds of integer ranges, which would make rare options common.)"""
    return st.sampled_from([False] * (n - 1) + [True])


def _axis_option(draw, mesh, name):
    """The default axis name (used when the mesh has it) or, sometimes, None (switched off)."""
    if name in dict(mesh) and draw(one_in(5)):
        return None
    return name


@st.composite
def _common_options(draw, mesh, *, zero_ok=True):
    """Keywords shared by the linear layers, the MLP, attention and the block."""
    low = draw(one_in(5))  # bfloat16 compute
    options = dict(
        model_axis=_axis_option(draw, mesh, "model"),
        data_axis=_axis_option(draw, mesh, "data"),
        sequence_axis=_axis_option(draw, mesh, "sequence"),
        sequence_parallel=draw(st.booleans()),
        use_bias=draw(st.booleans()),
        dtype="bfloat16" if low else draw(st.sampled_from([None, "float32"])),
        implementation=draw(st.sampled_from([None, "xla", "reference"])),
        precision=None if low else draw(st.sampled_from([None, "highest"])),
        zero=draw(st.sampled_from([0, 1, 2, 3, 3])) if zero_ok else 0,
    )
    if options["zero"] == 3:
        options["reshard_after_forward"] = draw(st.booleans())
        options["reduce_dtype"] = draw(st.sampled_from(["float32", None])) if not low else "float32"
    return options


def _sequence_shards(case_axes, options, zigzag: bool) -> int:
    sequence = options.get("sequence_axis")
    cp = case_axes.get(sequence, 1) if sequence else 1
    tp = case_axes.get(options.get("model_axis"), 1) if options.get("model_axis") else 1
    shards = cp * (tp if options.get("sequence_parallel") else 1)
    return shards * (2 if zigzag and cp > 1 else 1)


def _attention_options(draw, axes, options, features):
    tp = axes.get(options["model_axis"], 1) if options["model_axis"] else 1
    heads = draw(st.sampled_from([h for h in (2, 4, 8) if h % tp == 0]))
    kv_heads = draw(
        st.sampled_from(
            [k for k in (1, 2, 4, 8) if heads % k == 0 and (k % tp == 0 or tp % k == 0)]
        )
    )
    head_dim = draw(st.sampled_from([None, None, 8]))
    if head_dim is None and features % heads:
        head_dim = 8
    return dict(
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        causal=draw(st.booleans()),
        layout=draw(st.sampled_from(["zigzag", "contiguous", "striped"])),
        rope_theta=draw(st.sampled_from([10000.0, 100.0])),
        window=draw(st.sampled_from([None, None, (3, 0), (2, 2), (None, 1)])),
        logit_softcap=draw(st.sampled_from([None, None, 5.0])),
    ), heads


# Perturbations that the API must refuse: (name, applies(case), match).
REFUSALS = (
    "model_axis",
    "fsdp_axis",
    "zero",
    "remat",
    "integer_x",
    "batch",
    "sequence",
    "num_heads",
    "layout",
    "activation",
)


@st.composite
def layer_cases(draw, kinds=LAYER_KINDS):
    """A `LayerCase`: a layer kind, a mesh, its options and input shape (mostly valid)."""
    kind = draw(st.sampled_from(kinds))
    block = draw(st.sampled_from(["mlp", "block"])) if kind == "stack" else None
    inner = block if kind == "stack" else kind
    stack = {}
    if kind == "stack":
        with_pipeline = draw(st.booleans())
        required = ("pipeline",) if with_pipeline else ()
        mesh = draw(meshes(("pipeline", *LAYER_AXES), required=required))
    else:
        mesh = draw(meshes())
    axes = dict(mesh)
    features = draw(st.sampled_from([16, 32]))
    options = {}
    if inner != "norm":
        options = draw(_common_options(mesh))
    if inner == "column":
        options.update(
            out_features=draw(st.sampled_from([16, 32])), gather_output=draw(st.booleans())
        )
    elif inner == "row":
        options.update(
            out_features=draw(st.sampled_from([16, 32])), input_is_parallel=draw(st.booleans())
        )
    elif inner == "mlp":
        options.update(
            hidden_features=draw(st.sampled_from([32, 64])),
            activation=draw(st.sampled_from(["gelu", "swiglu"])),
        )
    elif inner in ("attention", "block"):
        extra, heads = _attention_options(draw, axes, options, features)
        options.update(extra, num_heads=heads)
        if inner == "block":
            options.update(
                hidden_features=draw(st.sampled_from([32, 64])),
                norm=draw(st.sampled_from(["rmsnorm", "layernorm"])),
                activation=draw(st.sampled_from(["gelu", "swiglu"])),
                remat=draw(st.sampled_from(REMAT)) if kind != "stack" else "none",
            )
    elif inner == "norm":
        options = dict(
            kind=draw(st.sampled_from(["rmsnorm", "layernorm"])),
            eps=draw(st.sampled_from([1e-6, 1e-2])),
            fsdp_axis="fsdp" if "fsdp" in axes and draw(st.booleans()) else None,
        )
    if kind == "stack":
        fsdp = axes.get("fsdp", 1) if options.get("zero") == 3 else 1
        layer_axis = "pipeline" if "pipeline" in axes and draw(st.booleans()) else None
        num_layers = draw(st.sampled_from([2, 4]))
        if layer_axis:
            num_layers = max(num_layers, axes["pipeline"])
        prefetch = (
            fsdp > 1
            and layer_axis is None
            and options.get("reshard_after_forward", True)
            and draw(st.booleans())
        )
        stack = dict(
            num_layers=num_layers,
            layer_axis=layer_axis,
            remat=draw(st.sampled_from(REMAT)),
            prefetch=prefetch,
        )
    zigzag = inner in ("attention", "block") and options.get("layout") == "zigzag"
    shards = _sequence_shards(axes, options, zigzag) if inner != "norm" else 1
    if inner == "column" and not options["sequence_parallel"]:
        shards = axes.get(options["sequence_axis"], 1) if options["sequence_axis"] else 1
    seq = max(8, shards)
    T = draw(st.sampled_from(sorted({seq, 2 * seq} & {8, 16}) or [seq]))
    batch_axes = [options.get("data_axis"), "fsdp" if options.get("zero") is not None else None]
    if inner == "norm":
        batch_axes = ["data"]
    per = 1
    for a in batch_axes:
        per *= axes.get(a, 1) if a else 1
    B = per * draw(st.sampled_from([1, 2]))
    call = (False, False)
    if inner in ("attention", "block"):
        call = (draw(st.booleans()), draw(one_in(4)))
    explicit, jit = draw(st.booleans()), draw(st.booleans())
    input_dtype = "float32"
    if kind == "stack" and options.get("dtype") == "bfloat16":
        # float32 activations (cast to the blocks' output dtype before the scan) or bfloat16
        input_dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    case = LayerCase(
        kind=kind,
        mesh=mesh,
        explicit=explicit,
        jit=jit,
        shape=(B, T, features),
        options=frozen(options),
        block=block,
        stack=frozen(stack),
        call=call,
        input_dtype=input_dtype,
    )
    if draw(one_in(10)):
        case = _refuse(draw, case)
    return case


def _refuse(draw, case: LayerCase) -> LayerCase:
    """`case` with one argument changed to a value the API must refuse (see `REFUSALS`)."""
    options, stack = dict(case.options), dict(case.stack)
    inner = case.block or case.kind
    B, T, F = case.shape
    candidates = ["model_axis", "zero", "integer_x"]
    if inner != "norm":
        candidates.append("fsdp_axis")
    else:
        candidates.remove("model_axis")
        candidates.remove("zero")
        candidates.append("fsdp_axis")
    if case.kind == "stack" or inner == "block":
        candidates.append("remat")
    if inner in ("attention", "block"):
        candidates += ["layout", "num_heads"]
        tp = case.size(options["model_axis"])
        if tp == 1:
            candidates.remove("num_heads")
    if inner in ("mlp", "block"):
        candidates.append("activation")
    batch = 1
    for a in (options.get("data_axis"), "fsdp" if inner != "norm" else None):
        batch *= case.size(a)
    if batch > 1 and inner != "norm":
        candidates.append("batch")
    zigzag = inner in ("attention", "block") and options.get("layout") == "zigzag"
    shards = _sequence_shards(case.axes, options, zigzag)
    if inner == "column" and not options["sequence_parallel"]:
        shards = case.size(options["sequence_axis"])
    if shards > 1 and inner != "norm":
        candidates.append("sequence")
    what = draw(st.sampled_from(candidates))
    shape, dtype, match = case.shape, case.input_dtype, what
    if what == "model_axis":
        options["model_axis"] = "tensor"
        match = "model_axis='tensor'"
    elif what == "fsdp_axis":
        options["fsdp_axis"] = "shards"
        match = "fsdp_axis='shards'"
    elif what == "zero":
        options["zero"] = 4
        match = "zero=4"
    elif what == "remat":
        if case.kind == "stack":
            stack["remat"] = "most"
        else:
            options["remat"] = "most"
        match = "remat='most'"
    elif what == "integer_x":
        dtype, match = "int32", "x has dtype int32"
    elif what == "batch":
        shape, match = (B + 1, T, F), "batch size B"
    elif what == "sequence":
        shape, match = (B, T + 1, F), f"T={T + 1}"
        if inner in ("column", "row", "mlp"):
            match = f"sequence length T={T + 1}"
    elif what == "num_heads":
        options["num_heads"] = options["num_heads"] + 1
        options["num_kv_heads"] = options["num_heads"]
        match = "num_heads="
    elif what == "layout":
        options["layout"] = "spiral"
        match = "layout='spiral'"
    elif what == "activation":
        options["activation"] = "relu"
        match = "activation='relu'"
    return dataclasses.replace(
        case,
        options=frozen(options),
        stack=frozen(stack),
        shape=shape,
        input_dtype=dtype,
        refusal=(what, match),
    )


@dataclasses.dataclass(frozen=True)
class PipelineCase:
    """One drawn pipeline configuration.

    Attributes:
      model: "mlp" (a residual MLP of `nnx.Linear`s, replicated activations) or
        "transformer" (`ParallelTransformerBlock`s, a norm and a tensor-parallel head).
      mesh_kind: a key of `PIPELINE_MESHES`.
      mesh: `((axis, size), ...)`.
      explicit: Explicit or Auto axis types.
      schedule, m, v, residuals: the `Pipeline` keywords.
      layers: L.
      block: `frozen` block options of the transformer (remat, sequence_parallel, activation,
        num_kv_heads) and of the stack.
      tied: the MLP model's head is the transposed embedding.
      refusal: None or `(what, match)`.
    """

    model: str
    mesh_kind: str
    mesh: tuple
    explicit: bool
    schedule: str
    m: int
    v: int
    residuals: str
    layers: int
    block: tuple = ()
    tied: bool = False
    refusal: tuple | None = None

    @property
    def p(self) -> int:
        return dict(self.mesh)["pipeline"]

    @property
    def model_key(self) -> tuple:
        """What the oracle depends on: the model, never the schedule or the mesh."""
        return (self.model, self.layers, self.block, self.tied)


@st.composite
def pipeline_cases(draw):
    """A `PipelineCase`: schedule x p x m x v x residuals x mesh (mostly valid)."""
    mesh_kind = draw(st.sampled_from(["pipeline", "pipeline", *PIPELINE_MESHES]))
    names = PIPELINE_MESHES[mesh_kind]
    p = draw(st.sampled_from([2, 2, 4, 1]))
    if len(names) == 3:
        p = min(p, 2)
    sizes = {"pipeline": p}
    for axis in names:
        if axis != "pipeline":
            sizes[axis] = 2
    mesh = tuple((a, sizes[a]) for a in names)
    schedule = draw(st.sampled_from(SCHEDULES))
    v = draw(st.sampled_from([2, 2, 4])) if schedule == "interleaved" else 1
    if p == 4:
        v = min(v, 2)
    layers = p * v if p * v >= 2 else 2
    if layers == p * v and p * v <= 2 and draw(st.booleans()):
        layers = 2 * p * v  # more than one layer per chunk
    if schedule == "interleaved":
        m = p * draw(st.sampled_from([1, 2]))
    elif schedule == "gpipe":
        m = draw(st.sampled_from([1, 2, 4]))
    else:
        m = p * draw(st.sampled_from([1, 2]))
    model = "transformer" if len(names) > 1 or draw(one_in(3)) else "mlp"
    block = {}
    if model == "transformer":
        block = dict(
            remat=draw(st.sampled_from(["none", "full", "selective"])),
            sequence_parallel=draw(st.booleans()),
            activation=draw(st.sampled_from(["gelu", "swiglu"])),
            num_kv_heads=draw(st.sampled_from([2, 4])),
        )
    case = PipelineCase(
        model=model,
        mesh_kind=mesh_kind,
        mesh=mesh,
        explicit=draw(st.booleans()),
        schedule=schedule,
        m=m,
        v=v,
        residuals=draw(st.sampled_from(["recompute", "stored"])),
        layers=layers,
        block=frozen(block),
        tied=model == "mlp" and draw(st.booleans()),
    )
    if draw(one_in(15)):
        case = _refuse_pipeline(draw, case)
    return case


def _refuse_pipeline(draw, case: PipelineCase) -> PipelineCase:
    candidates = ["schedule", "residuals", "virtual_stages"]
    if case.p * case.v > 1:
        candidates.append("layers")
    if case.p > 1 and case.schedule != "gpipe":
        candidates.append("microbatches")
    if case.schedule == "interleaved" and case.p > 1:
        candidates.append("interleaved_m")
    what = draw(st.sampled_from(candidates))
    if what == "schedule":
        return dataclasses.replace(case, schedule="looping", refusal=(what, "schedule='looping'"))
    if what == "residuals":
        return dataclasses.replace(case, residuals="offload", refusal=(what, "residuals='offload'"))
    if what == "virtual_stages":
        if case.schedule == "interleaved":
            return dataclasses.replace(case, v=0, refusal=(what, "virtual_stages=0"))
        return dataclasses.replace(case, v=2, refusal=(what, "virtual_stages=2"))
    if what == "layers":
        return dataclasses.replace(
            case, layers=case.p * case.v + 1, refusal=(what, f"num_layers={case.p * case.v + 1}")
        )
    if what == "microbatches":
        m = case.p - 1
        return dataclasses.replace(case, m=m, refusal=(what, f"num_microbatches={m}"))
    m = case.p + 1  # interleaved: m not a multiple of p
    return dataclasses.replace(case, m=m, refusal=(what, f"num_microbatches={m}"))
