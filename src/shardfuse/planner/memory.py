"""Memory per device of one training step: the terms `cost.estimate` reports.

Parameters, gradients and optimizer state per ZeRO stage; the activations
each block keeps for its backward pass per remat policy (Korthikanti et al.
2022's accounting, with the tensors counted in shardfuse's layers) over the
layers of a pipeline chunk, and a pipeline's stage inputs in flight and its
buffers; the logits or one layer's backward working set (flash-attention
tiles, q/k/v/o, the collective matmuls' buffers, ZeRO-3's gathered layers),
whichever is larger; the ZeRO update's working memory beyond the backward
pass's; the outputs when not donated. Checked against the compiled training
steps of tests/planner/test_memory.py; the fitted terms say so.

A mixture of experts: the routed experts' weights (and so their gradients and
optimizer state) are sharded over `expert` x `model` (expert parallelism, expert
tensor parallelism), then over `fsdp` per ZeRO stage like every weight; a token's
activations hold its `top_k` routed copies (`ModelSpec.mlp_width`) and the
dispatched and combined `[tokens x top_k, h]` buffers. Not yet checked against
compiled MoE programs (the MoE layers land with issue 44's other half).
See `cost` for the notation.
"""

import functools

from shardfuse.model_spec import ModelSpec
from shardfuse.parallel.pipeline.balance import balance_stages
from shardfuse.parallel.pipeline.lockstep import lockstep_table
from shardfuse.parallel.pipeline.schedule import closed_form_in_flight
from shardfuse.planner.options import Assumptions, Parallelism
from shardfuse.planner.terms import Term

# The terms alive only through the backward pass (freed before the optimizer update).
BACKWARD_TRANSIENT = ("activations", "pipeline_buffers", "logits", "layer_working_set")

# h-wide buffers per token and layer of a pipeline tick's chunk that the compiled
# pipelines hold beyond the other terms (fitted to tests/planner/test_memory.py's
# pipeline configurations, all schedules and remat policies, on XLA:CPU).
PIPELINE_TICK_BUFFERS = 8

# Full-sequence [tokens, h] buffers of one layer's collective matmuls over `model`
# alive at its backward pass (the all-gathered inputs of the QKV and MLP-up
# projections, the reduce-scatter partial sums of the output and MLP-down
# projections, their cotangents and the re-gathered inputs of the weight
# gradients), as buffers of the full sequence: `3 + 10 / T`. Fitted to the
# compiled programs of tests/planner/test_memory.py (about 8 at T = 2, 5-6 at
# T = 4, 4-5 at T = 8: the ring chunks, 1 / T of a buffer each, shrink with T).


def collective_buffers(model_size: int) -> float:
    """Full-sequence `[tokens, h]` buffers of one layer's collective matmuls at `model_size`.

    Example:
      >>> from shardfuse.planner.memory import collective_buffers
      >>> collective_buffers(1), collective_buffers(2), collective_buffers(8)
      (0.0, 8.0, 4.25)
    """
    return 3 + 10 / model_size if model_size > 1 else 0.0


def receive_factor(parallelism: Parallelism, a: Assumptions) -> int:
    """The expert-parallel receive buffers' rows over the routed rows they serve: `E` (the
    expert axis) where they are static (`Assumptions.ep_static_receive`: shardfuse, in
    JAX, sizes them for the worst case, a device receiving every routed row of its group,
    dropless), else 1 (sized by the routing; also without an expert axis, and for a
    capacity-padded dense dispatch, whose buffers are its capacity).

    Example:
      >>> from shardfuse.planner.memory import receive_factor
      >>> from shardfuse.planner.options import Assumptions, Parallelism
      >>> p = Parallelism.of(expert=8)
      >>> receive_factor(p, Assumptions()), receive_factor(p, Assumptions.preset("megatron-moe"))
      (8, 1)
    """
    E = parallelism.expert
    padded = a.expert_capacity_padded and parallelism.options.capacity_factor is not None
    return E if E > 1 and a.ep_static_receive and not padded else 1


def saved_elements_per_token(
    model: ModelSpec, parallelism: Parallelism, a: Assumptions, seq_len: int = 1
) -> dict:
    """Elements each block keeps per token for its backward pass, per device, by policy.

    Returns `{"full_layer": ..., "saved": ..., "lse": ..., "scores": ..., "qkvo": ...}`:
    a whole layer's saved tensors (the "none" policy), what `parallelism.options.remat`
    keeps, the float32 row statistics of flash attention, the bytes of
    materialised scores per token (no flash attention: Korthikanti et al.
    2022's `5 a s^2 b` per layer, i.e. `attention_scores_bytes_per_key` bytes
    per local head and key, `seq_len` keys per query, kept by the "none"
    policy only), and q, k, v and o.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import saved_elements_per_token
      >>> from shardfuse.planner.options import Assumptions, Parallelism
      >>> tiny = models.ModelSpec("t", 64, 8, 4, 8, 128, num_layers=1, vocab_size=128)
      >>> saved_elements_per_token(tiny, Parallelism.of(remat="full"), Assumptions())["saved"]
      64.0
    """
    t = parallelism.model
    h, d, f = model.hidden, model.head_dim, model.mlp_width()
    heads = model.heads / t
    kv_heads = max(model.kv_heads / t, 1.0)
    token_split = t if (a.sequence_parallel or a.residual_sharded) else 1
    swiglu = model.mlp_matrices == 3  # gated (swiglu, swiglu_clamped)
    # "none": what autodiff keeps, counted in shardfuse's layers with
    # `jax.ad_checkpoint.print_saved_residuals`: six h-sized tensors per token
    # (block input, norms' inputs and outputs, residual), q, k, v, the attention
    # output twice (kernel parallelism and o-proj input), and six f-sized SwiGLU
    # intermediates; a GELU MLP keeps its two (Korthikanti et al. 2022).
    residual = 6 * h / token_split
    qkv = (heads + 2 * kv_heads) * d
    out = 2 * heads * d
    mlp = (6 if swiglu else 2) * f / t
    up = (2 if swiglu else 1) * f / t  # the MLP up-projection's output
    scores = 0.0 if a.flash_attention else heads * a.attention_scores_bytes_per_key * seq_len
    # A mixture of experts keeps the dispatched copies of its tokens (the grouped matmul's
    # input, `top_k` rows of h per token) and the experts' outputs before the combine.
    moe_fraction = len(model.moe_layers) / model.num_layers
    dispatched = model.top_k * h / a.moe_token_split(t) * moe_fraction
    kept_rows = 2.0
    receive = receive_factor(parallelism, a) if model.moe_layers else 1
    if receive > 1:
        # Static receive buffers of `E x` the routed rows (`receive_factor`): the experts'
        # part of the MLP and the routed rows are kept over all of them, the rows three
        # times (received, in expert order, masked to this device's experts) and the mask
        # (one byte an element), as `print_saved_residuals` counts shardfuse's layer.
        routed = model.top_k * model.expert_ffn_hidden * moe_fraction
        mlp += (receive - 1) * (6 if swiglu else 2) * routed / t
        up += (receive - 1) * (2 if swiglu else 1) * routed / t
        dispatched *= receive
        kept_rows = 3 + 1 / a.activation_bytes
    full = residual + qkv + out + mlp
    if a.saved_activations == "korthikanti":
        # Megatron-LM's layers (Korthikanti et al. 2022, sec. 4.1, in elements of
        # `activation_bytes`): the two norms' inputs and outputs and the two 1-byte dropout
        # masks, replicated over `model` without sequence parallelism ("10 sbh"), and over
        # `model`: q, k, v, the output projection's input, the MLP activation's input(s)
        # and output ("24 sbh / t" for a GELU MLP of 4h). "selective" recomputes the
        # attention core only: all of it but the scores.
        full = (4 * h + 2 * h / a.activation_bytes) / token_split + qkv + heads * d + up + f / t
    full += kept_rows * dispatched
    # The ZeRO-3 layer prefetch keeps each layer's input only, as "full" does (the policy
    # applies inside the layer's rerun, in its backward working set).
    policy = "full" if parallelism.options.prefetch else parallelism.options.remat
    if policy == "none":
        saved = full
    elif policy in ("selective", "dots") and a.saved_activations == "korthikanti":
        saved, scores = full, 0.0
    elif policy in ("selective", "dots"):
        # `shardfuse.layers.remat`: the linear projections' outputs that the backward
        # pass needs (q, k/v, attention out, MLP up) and the block input; "dots" also
        # the attention core's output.
        saved = 2 * h / token_split + qkv + up + (heads * d if policy == "dots" else 0.0)
        saved += dispatched  # the grouped matmul's input, which the backward reads
        scores = 0.0
    else:  # "full", "offload": the layer input only (offload: the rest goes to the host)
        saved, scores = h / token_split, 0.0
    qkvo = qkv + heads * d  # q, k, v and the attention output: a layer backward's operands
    return {"full_layer": full, "saved": saved, "lse": heads, "scores": scores, "qkvo": qkvo}


@functools.lru_cache(maxsize=256)
def _stage_layers(num_layers: int, stages: int) -> tuple:
    return balance_stages([1.0] * num_layers, stages)


def slowest_stage_layers(model: ModelSpec, parallelism: Parallelism) -> float:
    """Layers of the fullest pipeline stage: `L / P`, or where P does not divide L the
    most of `sf.parallel.balance_stages`'s split (layers of equal cost), which a
    `Stack(stage_layers=...)` pads every stage to.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import slowest_stage_layers
      >>> from shardfuse.planner.options import Parallelism
      >>> slowest_stage_layers(models.get("llama3-405b"), Parallelism.of(pipeline=16))  # 126 layers
      8
    """
    L, P = model.num_layers, parallelism.pipeline
    if L % P == 0:
        return L / P
    return max(_stage_layers(L, P))


def layer_params_per_device(model: ModelSpec, parallelism: Parallelism) -> float:
    """One block's weights on one device, the mean over the blocks: the matmul weights over
    T, the routed experts' over E x T (expert parallelism, expert tensor parallelism), the
    norms whole.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import layer_params_per_device
      >>> from shardfuse.planner.options import Parallelism
      >>> mixtral = models.get("mixtral-8x7b")
      >>> expert = 3 * 4096 * 14336
      >>> layer_params_per_device(mixtral, Parallelism(expert=8)) == (
      ...     mixtral.layer_params() - 7 * expert)
      True
    """
    T, E, h = parallelism.model, parallelism.expert, model.hidden
    experts = model.routed_expert_params(active=False)
    return (model.layer_params() - experts - 2 * h) / T + experts / (E * T) + 2 * h


def params_per_device(model: ModelSpec, parallelism: Parallelism, a: Assumptions) -> float:
    """Parameters one device holds before ZeRO: a stage's layers over T (routed experts over
    E x T: `layer_params_per_device`), the embedding tables.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import params_per_device
      >>> from shardfuse.planner.options import Assumptions, Parallelism
      >>> model = models.get("llama3-8b")
      >>> params_per_device(model, Parallelism(), Assumptions()) == model.num_params()
      True
    """
    T, P, h, V = parallelism.model, parallelism.pipeline, model.hidden, model.vocab_size
    layer = layer_params_per_device(model, parallelism)
    table_in = V * h / (T if a.embedding_sharded else 1)
    table_out = V * h / T
    if P == 1:
        tables = table_in + (0 if model.tied_embeddings else table_out)
    else:  # first stage: input table, last stage: output table (tied: a copy on each)
        tables = max(table_in, table_out)
    return slowest_stage_layers(model, parallelism) * layer + tables + h


def table_params_per_device(model: ModelSpec, parallelism: Parallelism, a: Assumptions) -> float:
    """The embedding and output tables' parameters on one device (`params_per_device`'s).

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import table_params_per_device
      >>> from shardfuse.planner.options import Assumptions, Parallelism
      >>> model = models.get("llama3-8b")
      >>> table_params_per_device(model, Parallelism(model=8), Assumptions()) == 2 * 128256 * 512
      True
    """
    layer = layer_params_per_device(model, parallelism)
    layers = slowest_stage_layers(model, parallelism) * layer
    return params_per_device(model, parallelism, a) - layers - model.hidden


def state_bytes(model: ModelSpec, parallelism: Parallelism, a: Assumptions) -> float:
    """Parameters + gradients + optimizer state per device: the memory no microbatching reduces.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import state_bytes
      >>> from shardfuse.planner.options import Assumptions, Parallelism
      >>> states = state_bytes(models.get("llama3-8b"), Parallelism.of(fsdp=8, zero=3),
      ...                      Assumptions())
      >>> round(states / 1e9, 2)
      18.07
    """
    params = params_per_device(model, parallelism, a)
    F, z = parallelism.fsdp, parallelism.options.zero
    return params * (
        a.param_bytes / (F if z >= 3 else 1)
        + a.grad_bytes / (F if z >= 2 else 1)
        + a.optimizer_bytes / (F if z >= 1 else 1)
    )


def zero_update_term(
    params_dev: float, parallelism: Parallelism, a: Assumptions, backward=0.0
) -> Term:
    """ZeRO-1/2/3's optimizer update on fsdp shards: its working memory beyond the backward's.

    The update runs on the shards: the gradient shard, the new parameters and
    the update, each a shard (`3 x params / F`); under ZeRO-1/2 the new
    parameters are then all-gathered, and without donated outputs that
    gathered copy is a temporary before it is written out (`params`). The
    update runs after the backward pass, whose activations and working set
    (`backward` bytes) are then free: the term is what it needs beyond them.
    Measured on the compiled steps of tests/planner/test_memory.py (8 CPU
    devices, float32): with remat "full" on (data 2, fsdp 4) the update sets
    the peak; with remat "none" the backward pass does.

    Example:
      >>> from shardfuse.planner.memory import zero_update_term
      >>> from shardfuse.planner.options import Assumptions, Parallelism
      >>> a = Assumptions.float32(donate=False)
      >>> zero_update_term(1e6, Parallelism.of(fsdp=4, zero=1), a).value
      7000000.0
      >>> zero_update_term(1e6, Parallelism.of(fsdp=4, zero=1), a, backward=5e6).value
      2000000.0
    """
    F, z = parallelism.fsdp, parallelism.options.zero
    shards = 3 * params_dev * a.param_bytes / F
    gathered = params_dev * a.param_bytes if (z < 3 and not a.donate) else 0.0
    update = shards + gathered
    return Term(
        "zero_update",
        max(0.0, update - backward),
        f"the update on fsdp={F} shards: gradient, new parameters and update, 3 x "
        f"{params_dev:.4g} x {a.param_bytes} B / {F}"
        + (
            f", plus the all-gathered new parameters ({params_dev:.4g} x {a.param_bytes} B, "
            "outputs not donated)"
            if gathered
            else ""
        )
        + f" = {update / 1e9:.4g} GB"
        + (
            ", in full beside the backward pass (ZeRO-3: fitted to compiled steps)"
            if z == 3
            else f", less the backward pass's {backward / 1e9:.4g} GB (not alive at the same time)"
        ),
    )


def attention_tiles(
    model: ModelSpec, parallelism: Parallelism, mb_tokens: float, seq_len: int
) -> float:
    """Bytes of the flash-attention backward's float32 tiles (p and ds) of one block.

    The xla kernel's backward holds two `[b, heads / T, bq, bk]` float32
    tiles at a time (`b` sequences of the microbatch); tiles are 256 wide, or
    half the local sequence under ring attention's zigzag parallelism (a tile never
    straddles its two chunks). On TPU and GPU the Pallas and Triton kernels
    keep them in on-chip memory; the term is small for long sequences anyway.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import attention_tiles
      >>> from shardfuse.planner.options import Parallelism
      >>> tiny = models.ModelSpec("t", 64, 8, 4, 8, 128, num_layers=1, vocab_size=128)
      >>> attention_tiles(tiny, Parallelism(), mb_tokens=256, seq_len=128)  # 2 sequences, 64-wide
      524288.0
    """
    local = seq_len / parallelism.sequence
    block = min(
        256.0, local / 2 if parallelism.sequence > 1 or parallelism.cp_strategy == "ring" else local
    )
    sequences = mb_tokens / local
    return 2 * sequences * model.heads / parallelism.model * block * block * 4


@functools.lru_cache(maxsize=4096)
def _peak_in_flight(schedule: str, stages: int, num_microbatches: int, virtual: int) -> float:
    """The most microbatches any stage holds from F to B in the lockstep table (the search
    asks for the same few tables tens of thousands of times).

    >>> _peak_in_flight("gpipe", 2, 4, 1), _peak_in_flight("1f1b", 2, 4, 1)
    (4.0, 3.0)
    """
    return float(max(lockstep_table(schedule, stages, num_microbatches, virtual).in_flight()))


@functools.lru_cache(maxsize=4096)
def _backward_ticks_outside_loops(schedule: str, stages: int, num_microbatches: int, virtual: int):
    """Ticks with a B slot that the executor scans alone (a segment of one tick): XLA inlines
    a scan of one iteration, and its scheduler then allocates that tick's residual buffers
    (the stage's layer-scan outputs, zero-initialised with no operand) at the start of the
    step, so they are live beside every loop before them.

    >>> [_backward_ticks_outside_loops(name, 2, 4, 1) for name in ("1f1b", "gpipe")]
    [1, 0]
    """
    from shardfuse.parallel.pipeline.executor import segments

    table = lockstep_table(schedule, stages, num_microbatches, virtual)
    return sum(
        1 for item in segments(table.active()) if item[0] == "scan" and item[1][2] and item[3] == 1
    )


def in_flight_microbatches(parallelism: Parallelism, a: Assumptions) -> float:
    """Microbatch-chunks the most loaded stage holds from their forward to their backward.

    The executor's table: shardfuse's lockstep executor (`lockstep.lockstep_table`: 1F1B
    and zb-h1 hold `min(m, 2 P - 1)`, a tick holding an F and a B), or an async one's
    (Megatron: `schedule.closed_form_in_flight`, 1F1B `min(m, P)`).

    Example:
      >>> from shardfuse.planner.memory import in_flight_microbatches
      >>> from shardfuse.planner.options import Assumptions, Parallelism
      >>> pipe = Parallelism.of(pipeline=4, num_microbatches=8)
      >>> in_flight_microbatches(pipe, Assumptions()), in_flight_microbatches(
      ...     pipe, Assumptions.megatron_2022())
      (7.0, 4.0)
    """
    o, P = parallelism.options, parallelism.pipeline
    if a.pipeline_executor == "async":
        return float(closed_form_in_flight(o.schedule, P, o.num_microbatches, o.virtual_stages))
    return _peak_in_flight(o.schedule, P, o.num_microbatches, o.virtual_stages)


def memory_terms(model, parallelism, a, params_dev, per_token, mb_tokens, layers_dev, seq_len):
    """The memory `Term`s of `cost.estimate` (see the module docstring); bytes per device.

    Persistent: parameters, gradients, optimizer state (per ZeRO stage) and,
    without donation, the step's outputs. Through the backward pass: the
    saved activations of the microbatches in flight. Transient, never alive
    together: the logits (loss and its gradient) and a layer's backward
    working set (flash-attention tiles, q, k, v and o, the
    collective matmuls' buffers, ZeRO-3's gathered layers); the larger sets
    the peak, and `layer_working_set` is its excess over `logits`.

    Example:
      >>> from shardfuse import hardware, models
      >>> from shardfuse.planner.cost import estimate
      >>> from shardfuse.planner.options import Parallelism
      >>> e = estimate(models.get("llama3-8b"), hardware.cluster("h100"),
      ...              Parallelism.of(fsdp=8, zero=3), global_batch=8, seq_len=4096)
      >>> [t.name for t in e.memory][:3]
      ['parameters', 'gradients', 'optimizer']
    """
    F, P, T, m = (
        parallelism.fsdp,
        parallelism.pipeline,
        parallelism.model,
        parallelism.options.num_microbatches,
    )
    z, v = parallelism.options.zero, parallelism.options.virtual_stages
    act, h = a.activation_bytes, model.hidden
    shard = lambda stage: F if z >= stage else 1  # noqa: E731
    params = params_dev * a.param_bytes / shard(3)
    grads = params_dev * a.grad_bytes / shard(2)
    grads_formula = f"{params_dev:.4g} x {a.grad_bytes} B / {shard(2)}"
    if z == 2 and F > 1 and P == 1:
        # `sf.parallel.accumulate` reduce-scatters each layer's gradient inside the layer
        # scan's backward (`fsdp.scatter_gradient`): the sharded buffer, one layer's whole
        # gradient (in `layer_working_set`), and the tables outside the Stack (embedding,
        # head), reduce-scattered once their whole gradient is done.
        tables = table_params_per_device(model, parallelism, a)
        grads += tables * a.grad_bytes * (1 - 1 / F)
        grads_formula += f" + the tables' whole gradients ({tables:.4g} x {a.grad_bytes} B)"
    elif z == 2 and F > 1:
        # A pipeline differentiates the whole stage (`sf.parallel.Pipeline`): its gradient
        # is whole until the optimizer update reduce-scatters it.
        grads = params_dev * a.grad_bytes
        grads_formula = f"{params_dev:.4g} x {a.grad_bytes} B (whole: a pipeline's gradient)"
    terms = [
        Term("parameters", params, f"{params_dev:.4g} params x {a.param_bytes} B / {shard(3)}"),
        Term("gradients", grads, grads_formula),
        Term(
            "optimizer",
            params_dev * a.optimizer_bytes / shard(1),
            f"{params_dev:.4g} x {a.optimizer_bytes} B / {shard(1)} (ZeRO-{z} over fsdp={F})",
        ),
    ]
    saved = per_token["saved"] * act + per_token["scores"]
    if parallelism.options.remat in ("none", "dots") and not parallelism.options.prefetch:
        saved += per_token["lse"] * 4
    chunk = layers_dev / v  # the layers one pipeline tick runs (a stage's chunk)
    stage = mb_tokens * saved * chunk  # one microbatch's saved activations, one chunk
    if P == 1:
        activations = stage
        what = (
            f"{mb_tokens:g} tokens x {saved / act:.4g} elements x {act} B x {layers_dev:g} layers"
        )
    elif not a.pipeline_recompute:
        # Residuals stored (`Pipeline(residuals="stored")`, Megatron): every microbatch in
        # flight keeps its chunk's saved activations (Korthikanti et al. 2022, sec. 4.2.3:
        # 1F1B's first stage holds P microbatches of L / P layers, L layers' worth).
        in_flight = in_flight_microbatches(parallelism, a)
        activations = in_flight * stage
        what = (
            f"{in_flight:.3g} microbatch-chunks in flight x {mb_tokens:g} tokens x "
            f"{saved / act:.4g} elements x {act} B x {chunk:g} layers (residuals stored)"
        )
    else:
        # The pipeline keeps each microbatch in flight as its stage input and recomputes
        # the stage forward in its backward tick (`Pipeline(residuals="recompute")`).
        # The executor's lockstep table: stage 0 holds its microbatches from F to B,
        # 2 P - 1 ticks for 1F1B (a tick holds an F and a B), all m for GPipe. A B tick
        # scanned alone keeps its recomputed chunk beside the loops' (measured on the
        # compiled steps of tests/planner/test_memory.py: 1F1B and zb-h1 at P = 2, whose
        # drain is one tick).
        in_flight = in_flight_microbatches(parallelism, a)
        inputs = in_flight * mb_tokens * h / T * act
        chunks = 1
        if a.pipeline_executor == "lockstep":
            chunks += _backward_ticks_outside_loops(parallelism.options.schedule, P, m, v)
        activations = inputs + chunks * stage
        what = (
            f"{in_flight:.3g} microbatches in flight x {mb_tokens:g} tokens x {h}/{T} x {act} B "
            f"(stage inputs) + {chunks} microbatch's recomputed chunk: {mb_tokens:g} tokens x "
            f"{saved / act:.4g} elements x {act} B x {chunk:g} layers"
        )
    terms.append(Term("activations", activations, f"{what} (remat={parallelism.options.remat})"))
    if P > 1 and a.pipeline_executor == "async":
        # An async executor (Megatron's) takes each microbatch from the data loader when its
        # first forward runs and accumulates the gradients in place: beyond the activations
        # in flight, a stage holds its send and receive buffers (an activation and a
        # gradient each way).
        split = T if a.sequence_parallel else 1
        sends = 4 * mb_tokens * h / split * act
        what = f"4 x {mb_tokens:g} tokens x {h}/{split} x {act} B (sends and receives)"
        terms.append(Term("pipeline_buffers", sends, what))
    elif P > 1:
        # the [m, b, T, F] pipeline input, its gradient and the stage outputs; the tick's
        # weight gradient beside its accumulator
        buffers = 3 * m * mb_tokens * h / T * act
        tick_grads = params_dev * a.grad_bytes / shard(2)
        # Fitted, not derived: the compiled pipelines of tests/planner/test_memory.py
        # (XLA:CPU) hold about 8 more h-wide float32 buffers per token and chunk layer
        # than the terms above, with every schedule and remat policy.
        switch = PIPELINE_TICK_BUFFERS * mb_tokens * h / T * chunk * act
        terms.append(
            Term(
                "pipeline_buffers",
                buffers + tick_grads + switch,
                f"3 x {m} x {mb_tokens:g} x {h}/{T} x {act} B (input, its gradient, outputs) + "
                f"one tick's weight gradient + {PIPELINE_TICK_BUFFERS} x {mb_tokens:g} x "
                f"{h}/{T} x {chunk:g} layers x {act} B (the tick's buffers, fitted)",
            )
        )
    if P == 1:
        # The gradient of the embedded batch: the transpose of the accumulation's microbatch
        # slicing, a zero-initialised [batch, s / C, h] buffer that the slices' gradients are
        # written into after the loop. Having no operand, XLA:CPU allocates it at the step's
        # start (jax 0.12, and 0.10.2's IR emitters: tests/planner/test_memory.py's buffer
        # assignments; 0.10.2's fusion emitters write it in place).
        tokens = m * mb_tokens
        what = f"{tokens:g} tokens of the replica's batch x {h} x {act} B (its gradient)"
        terms.append(Term("input_gradient", tokens * h * act, what))
    logits = mb_tokens * model.vocab_size / T * a.logits_bytes * a.logits_copies
    terms.append(
        Term(
            "logits",
            logits,
            f"{mb_tokens:g} tokens x {model.vocab_size}/{T} vocab x {a.logits_bytes} B x "
            f"{a.logits_copies} copies",
        )
    )
    qkvo = per_token["qkvo"]
    tiles = attention_tiles(model, parallelism, mb_tokens, seq_len) if a.flash_attention else 0.0
    parts = [f"{mb_tokens:g} tokens x {qkvo:g} (q, k, v, o) x {act} B"]
    work = mb_tokens * qkvo * act + tiles
    if tiles:
        parts.append(f"flash-attention tiles {tiles / 1e6:.4g} MB")
    if T > 1:
        buffers = collective_buffers(T)
        work += buffers * mb_tokens * h * act
        parts.append(f"{buffers:.3g} [{mb_tokens:g}, {h}] collective-matmul buffers")
    experts = model.routed_expert_params(active=False)
    gathered = (model.layer_params() - experts + experts / parallelism.expert) / T  # one layer
    if z == 3 and F > 1:
        layer = gathered * a.param_bytes
        if parallelism.options.prefetch:  # the next layer's weights, gathered meanwhile
            work += 4 * layer
            parts.append("4 gathered layers (two weights, the next layer's, one whole gradient)")
        else:
            work += 3 * layer
            parts.append("3 gathered layers (two weights, one whole gradient)")
    elif z == 2 and F > 1 and P == 1:
        work += gathered * a.grad_bytes
        parts.append("one layer's whole gradient (before its reduce-scatter)")
    terms.append(
        Term(
            "layer_working_set",
            max(0.0, work - logits),
            f"one layer's backward, {work / 1e9:.4g} GB: "
            + " + ".join(parts)
            + " (less the logits, which are not alive at the same time)",
        )
    )
    if z >= 1 and F > 1:
        # ZeRO-3 counts it in full: its compiled steps hold about that much beyond the
        # other terms, with any policy (ratio 0.87-0.94 in the grid, 0.77 without); the
        # cause is not identified.
        backward = sum(t.value for t in terms if t.name in BACKWARD_TRANSIENT) if z < 3 else 0.0
        terms.append(zero_update_term(params_dev, parallelism, a, backward))
    if not a.donate:
        outputs = params + params_dev * a.optimizer_bytes / shard(1)
        terms.append(Term("outputs", outputs, "new parameters and optimizer state (not donated)"))
    return terms
