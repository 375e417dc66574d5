"""Memory per device of one training step: the terms `cost.estimate` reports.

Parameters, gradients and optimizer state per ZeRO stage; the activations
each block keeps for its backward pass per remat policy (Korthikanti et al.
2022's accounting, with the tensors counted in shardfuse's layers), times the
layers of a pipeline stage and the microbatches in flight; one layer's
working set in its backward pass; the collective matmuls' full-sequence
buffers; the logits; ZeRO-3's gathered layers; the ZeRO update's working memory; the
outputs when not donated.
See `cost` for the notation.
"""

from shardfuse.models import ModelShape
from shardfuse.planner.options import Assumptions, Layout
from shardfuse.planner.terms import Term

# Full-sequence [tokens, h] buffers of one layer's collective matmuls over `model`
# alive at its backward pass (the all-gathered inputs of the QKV and MLP-up
# projections, the reduce-scatter partial sums of the output and MLP-down
# projections, their cotangents and the re-gathered inputs of the weight
# gradients), as buffers of the full sequence: `4 + 12 / T`. Fitted to the
# compiled programs of tests/planner/test_memory.py (about 10 at T = 2, 9-10 at
# T = 4, 6 at T = 8: the ring chunks, 1 / T of a buffer each, shrink with T).


def collective_buffers(model_size: int) -> float:
    """Full-sequence `[tokens, h]` buffers of one layer's collective matmuls at `model_size`.

    Example:
      >>> from shardfuse.planner.memory import collective_buffers
      >>> collective_buffers(1), collective_buffers(2), collective_buffers(8)
      (0.0, 10.0, 5.5)
    """
    return 4 + 12 / model_size if model_size > 1 else 0.0


def saved_elements_per_token(model: ModelShape, layout: Layout, a: Assumptions) -> dict:
    """Elements each block keeps per token for its backward pass, per device, by policy.

    Returns `{"full_layer": ..., "saved": ..., "lse": ...}`: a whole layer's
    saved tensors (the "none" policy, also the recompute working set), what
    `layout.remat` keeps, and the float32 row statistics of flash attention.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import saved_elements_per_token
      >>> from shardfuse.planner.options import Assumptions, Layout
      >>> tiny = models.ModelSpec("t", 64, 8, 4, 8, 128, num_layers=1, vocab_size=128)
      >>> saved_elements_per_token(tiny, Layout(remat="full"), Assumptions())["saved"]
      64.0
    """
    t = layout.model
    h, d, f = model.hidden, model.head_dim, model.ffn_hidden
    heads = model.heads / t
    kv_heads = max(model.kv_heads / t, 1.0)
    token_split = t if a.sequence_parallel else 1
    swiglu = model.activation == "swiglu"
    # "none": what autodiff keeps, counted in shardfuse's layers with
    # `jax.ad_checkpoint.print_saved_residuals`: six h-sized tensors per token
    # (block input, norms' inputs and outputs, residual), q, k, v, the attention
    # output twice (kernel layout and o-proj input), and six f-sized SwiGLU
    # intermediates; a GELU MLP keeps its two (Korthikanti et al. 2022).
    residual = 6 * h / token_split
    qkv = (heads + 2 * kv_heads) * d
    out = 2 * heads * d
    mlp = (6 if swiglu else 2) * f / t
    up = (2 if swiglu else 1) * f / t  # the MLP up-projection's output
    scores = 0.0 if a.flash_attention else heads * a.attention_scores_bytes_per_key
    full = residual + qkv + out + mlp
    policy = layout.remat
    if policy == "none":
        saved = full
    elif policy in ("selective", "dots"):
        # `shardfuse.layers.remat`: the linear projections' outputs that the backward
        # pass needs (q, k/v, attention out, MLP up) and the block input; "dots" also
        # the attention core's output.
        saved = 2 * h / token_split + qkv + up + (heads * d if policy == "dots" else 0.0)
        scores = 0.0
    else:  # "full", "offload": the layer input only (offload: the rest goes to the host)
        saved, scores = h / token_split, 0.0
    return {"full_layer": full, "saved": saved, "lse": heads, "scores": scores}


def params_per_device(model: ModelShape, layout: Layout, a: Assumptions) -> float:
    """Parameters one device holds before ZeRO: a stage's layers over T, the embedding tables.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import params_per_device
      >>> from shardfuse.planner.options import Assumptions, Layout
      >>> model = models.get("llama3-8b")
      >>> params_per_device(model, Layout(), Assumptions()) == model.num_params()
      True
    """
    T, P, h, V = layout.model, layout.pipeline, model.hidden, model.vocab_size
    layer = (model.layer_params() - 2 * h) / T + 2 * h
    table_in = V * h / (T if a.embedding_sharded else 1)
    table_out = V * h / T
    if P == 1:
        tables = table_in + (0 if model.tied_embeddings else table_out)
    else:  # first stage: input table, last stage: output table (tied: a copy on each)
        tables = max(table_in, table_out)
    return model.num_layers / P * layer + tables + h


def state_bytes(model: ModelShape, layout: Layout, a: Assumptions) -> float:
    """Parameters + gradients + optimizer state per device: the memory no microbatching reduces.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.memory import state_bytes
      >>> from shardfuse.planner.options import Assumptions, Layout
      >>> states = state_bytes(models.get("llama3-8b"), Layout(fsdp=8, zero=3), Assumptions())
      >>> round(states / 1e9, 2)
      18.07
    """
    params = params_per_device(model, layout, a)
    F, z = layout.fsdp, layout.zero
    return params * (
        a.param_bytes / (F if z >= 3 else 1)
        + a.grad_bytes / (F if z >= 2 else 1)
        + a.optimizer_bytes / (F if z >= 1 else 1)
    )


def zero_update_term(params_dev: float, layout: Layout, a: Assumptions) -> Term:
    """ZeRO-1/2/3's optimizer update on fsdp shards: its working memory per device.

    The update runs on the shards: the new parameters and the update, each a
    shard (`2 x params / F`); under ZeRO-1/2 the new parameters are then
    all-gathered, and without donated outputs that gathered copy is a
    temporary before it is written out (`params`). Measured on the compiled
    training step of tests/planner/test_memory.py (8 CPU devices, float32):
    ZeRO-1 on (data 2, fsdp 4) holds 1.00 MB more temporary memory than the
    same step on (data 8) with ZeRO-0, for 0.66 MB of parameters: `0.66 +
    2 x 0.66 / 4 = 0.99` MB.

    Example:
      >>> from shardfuse.planner.memory import zero_update_term
      >>> from shardfuse.planner.options import Assumptions, Layout
      >>> a = Assumptions.float32(donate=False)
      >>> zero_update_term(1e6, Layout(fsdp=4, zero=1), a).value
      6000000.0
    """
    F, z = layout.fsdp, layout.zero
    shards = 2 * params_dev * a.param_bytes / F
    gathered = params_dev * a.param_bytes if (z < 3 and not a.donate) else 0.0
    return Term(
        "zero_update",
        shards + gathered,
        f"the update on fsdp={F} shards: new parameters and update, 2 x {params_dev:.4g} x "
        f"{a.param_bytes} B / {F}"
        + (
            f", plus the all-gathered new parameters ({params_dev:.4g} x {a.param_bytes} B, "
            "outputs not donated)"
            if gathered
            else ""
        ),
    )


def memory_terms(model, layout, a, params_dev, per_token, mb_tokens, layers_dev) -> list[Term]:
    """The memory `Term`s of `cost.estimate` (see the module docstring); bytes per device.

    Example:
      >>> from shardfuse import hardware, models
      >>> from shardfuse.planner.cost import estimate
      >>> from shardfuse.planner.options import Layout
      >>> e = estimate(models.get("llama3-8b"), hardware.cluster("h100"), Layout(fsdp=8, zero=3),
      ...              global_batch=8, seq_len=4096)
      >>> [t.name for t in e.memory][:3]
      ['parameters', 'gradients', 'optimizer']
    """
    F, P, T, m, v = layout.fsdp, layout.pipeline, layout.model, layout.num_microbatches, 1
    z = layout.zero
    act = a.activation_bytes
    v = layout.virtual_stages
    shard = lambda stage: F if z >= stage else 1  # noqa: E731
    params = params_dev * a.param_bytes / shard(3)
    terms = [
        Term("parameters", params, f"{params_dev:.4g} params x {a.param_bytes} B / {shard(3)}"),
        Term(
            "gradients",
            params_dev * a.grad_bytes / shard(2),
            f"{params_dev:.4g} x {a.grad_bytes} B / {shard(2)}",
        ),
        Term(
            "optimizer",
            params_dev * a.optimizer_bytes / shard(1),
            f"{params_dev:.4g} x {a.optimizer_bytes} B / {shard(1)} (ZeRO-{z} over fsdp={F})",
        ),
    ]
    if z == 3 and F > 1:
        layer = model.layer_params() / T * a.param_bytes
        terms.append(Term("zero3_gathered", 2 * layer, "two gathered layers (one prefetched)"))
    if z >= 1 and F > 1:
        terms.append(zero_update_term(params_dev, layout, a))
    if P == 1:
        in_flight = 1.0
    elif layout.schedule == "gpipe":
        in_flight = float(m)
    else:
        in_flight = float(min(m, P))
        if layout.schedule == "interleaved":
            in_flight *= 1 + (P - 1) / (P * v)
    saved = per_token["saved"] * act + per_token["scores"]
    if layout.remat in ("none", "dots"):
        saved += per_token["lse"] * 4
    stage0 = mb_tokens * saved * layers_dev * in_flight
    logits = mb_tokens * model.vocab_size / T * a.logits_bytes * a.logits_copies
    last = mb_tokens * saved * layers_dev + logits
    activations = max(stage0, last) - logits if P > 1 else stage0
    terms.append(
        Term(
            "activations",
            activations,
            f"{mb_tokens:g} tokens x {saved / act:.4g} elements x {act} B x {layers_dev:g} "
            f"layers x {in_flight:.3g} microbatches in flight (remat={layout.remat})",
        )
    )
    work = mb_tokens * (per_token["full_layer"] * act + per_token["lse"] * 4)
    terms.append(
        Term(
            "layer_working_set",
            work,
            "one layer's activations (recomputed unless remat='none') and their cotangents "
            "while it runs backward",
        )
    )
    if T > 1:
        buffers = collective_buffers(T)
        ring = buffers * mb_tokens * model.hidden * act
        terms.append(
            Term(
                "collective_buffers",
                ring,
                f"{buffers:.3g} [{mb_tokens:g}, {model.hidden}] buffers of one layer's "
                "collective matmuls (gathered inputs, partial sums; forward and backward)",
            )
        )
    terms.append(
        Term(
            "logits",
            logits,
            f"{mb_tokens:g} tokens x {model.vocab_size}/{T} vocab x {a.logits_bytes} B x "
            f"{a.logits_copies} copies",
        )
    )
    if not a.donate:
        outputs = params + params_dev * a.optimizer_bytes / shard(1)
        terms.append(Term("outputs", outputs, "new parameters and optimizer state (not donated)"))
    return terms
