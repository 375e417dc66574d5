"""Communication terms of one training step: every collective, its total time and what is exposed.

Each collective is a ring over the link its mesh axis maps to
(`cost.axis_link`): all-gather and reduce-scatter move `(n - 1) / n` of the
full buffer, all-reduce twice that, plus `(n - 1)` link latencies
(`shardfuse.ring_time.ring_collective_s`). A term's `total` is the whole
collective time; its `value` is what is exposed: `max(0, total - overlap x
window)`, where `window` is the compute that runs beside it when the schedule
lets it overlap at all, and `overlap` the hardware's fraction
(`Assumptions.overlap_for`, `efficiency.overlap_fraction`). Collectives on the
same link share one window: ZeRO-3's gradient reduce-scatters hide only behind
the backward compute that its parameter gathers left free.

- tensor_parallel (Megatron, with or without sequence parallelism): 4
  all-gathers/reduce-scatters (or 2 all-reduces) of the `[mb, s / C, h]`
  activation per layer forward, 4 backward, 4 more when "full" remat reruns the
  forward; with `tp_overlap` (collective-matmul rings) hidden behind `(T - 1) / T`
  of the layer's matmuls.
- context_parallel: ring attention sends K/V `C - 1` times forward and 2 (C - 1)
  times backward (K/V and dK/dV), hidden behind `(C - 1) / C` of the attention.
- fsdp_gather (ZeRO-3): the parameters all-gathered every microbatch's forward
  and backward (and the remat forward, but with the layer prefetch), prefetched
  behind the layers' compute.
- data_parallel: the gradient reduction: all-reduce over data x fsdp (ZeRO-0/1),
  reduce-scatter over fsdp then all-reduce of the shards over data and
  all-gather of the new parameters (ZeRO-2; with accumulation and
  `Assumptions.zero2_scatter="microbatch"`, shardfuse's `accumulate`, a
  reduce-scatter per microbatch behind its own backward and the gather of the
  updated parameters, exposed, as `fsdp_gather`), or a reduce-scatter per
  microbatch (ZeRO-3). The reduction of the last microbatch's gradients can hide only
  behind that microbatch's backward (`2/3 x compute / m`), ZeRO-3's per-
  microbatch reduce-scatters behind every backward.
- pipeline_p2p: the stage-boundary sends: shardfuse's lockstep executor
  ppermutes both directions every tick, exposed; an async pipeline sends
  `2 v m` times, hidden with `pp_overlap`.
"""

from shardfuse.planner.terms import Term
from shardfuse.ring_time import ring_collective_s as ring
from shardfuse.ring_time import ring_transfer_s


def exposed_term(name, total, window, overlap, what):
    """A `Term` of value `total - overlap x min(total, window)`; `total` kept beside it.

    The part of the collective that runs beside compute (at most `window`)
    hides but for `1 - overlap` of it (on GPUs the collective's kernels take
    SMs and HBM bandwidth from the compute they overlap); the rest is exposed.

    Example:
      >>> from shardfuse.planner.comm import exposed_term
      >>> exposed_term("x", 4.0, 10.0, 0.75, "a collective").value
      1.0
    """
    hidden = overlap * min(total, window)
    formula = f"{what}: {total:.3g} s"
    if hidden > 0:
        formula += (f", {hidden:.3g} s hidden ({overlap:g} x min(total, {window:.3g} s of "
                    "overlapping compute))")  # fmt: skip
    else:
        formula += ", exposed"
    return Term(name, max(0.0, total - hidden), formula, total)


def tensor_parallel_term(*, T, mb, s, C, h, act, layer_microbatches, reruns_forward, link,
                         matmul_s, a, overlap):  # fmt: skip
    """The tensor-parallel collectives of the step (see the module docstring); 4 more per
    layer when the backward reruns its forward (`reruns_forward`: remat "full", prefetch)."""
    bw, lat, name = link
    collectives = 8 + (4 if reruns_forward else 0)
    per_layer = ring(T, mb * s / C * h * act, bw, lat) * collectives
    total = layer_microbatches * per_layer
    window = (T - 1) / T * matmul_s if a.tp_overlap else 0.0
    what = (f"{layer_microbatches:g} layer-microbatches x {collectives} all-gather/reduce-scatter "
            f"of [{mb}, {s // C}, {h}] over model={T} on {name}")  # fmt: skip
    return exposed_term("tensor_parallel", total, window, overlap, what), collectives


def context_parallel_term(model, parallelism, a, *, mb_tokens, layer_microbatches,
                          reruns_forward, link, attention_s, overlap):  # fmt: skip
    """The context-parallel attention's K/V traffic over `sequence` (module docstring):
    Ulysses' all-to-alls, exposed; a ring's K/V sends (once more when the backward
    reruns the forward), hidden behind `(C - 1) / C` of the attention `attention_s`."""
    C, T, act = parallelism.sequence, parallelism.model, a.activation_bytes
    bw, lat, name = link
    kv_heads = max(model.kv_heads / T, 1.0)
    kv_bytes = mb_tokens * kv_heads * model.head_dim * 2 * act
    strategy = parallelism.cp_strategy
    if strategy == "ulysses":
        q_bytes = mb_tokens * model.heads / T * model.head_dim * act
        local = 2 * q_bytes + kv_bytes  # q, out and k, v
        cp = layer_microbatches * 2 * ring(C, local, bw, lat)
        window = 0.0
    else:  # ring, ulysses_ring (modelled as ring), all_gather
        hops = 3 + (1 if reruns_forward else 0)
        cp = layer_microbatches * hops * ring_transfer_s(C, kv_bytes, bw, lat)
        overlapped = a.cp_overlap and strategy != "all_gather"
        window = (C - 1) / C * attention_s if overlapped else 0.0
    what = f"{strategy} attention over sequence={C} on {name}: K/V traffic"
    return exposed_term("context_parallel", cp, window, overlap, what)


def data_parallel_terms(*, parallelism, params_dev, a, links, compute_s, overlap):
    """`fsdp_gather` (ZeRO-3) and `data_parallel` (the gradient reduction) terms."""
    D, F, m, z = (
        parallelism.data,
        parallelism.fsdp,
        parallelism.options.num_microbatches,
        parallelism.options.zero,
    )
    (bw_d, lat_d, name_d), (bw_f, lat_f, name_f) = links
    g = params_dev * a.grad_comm_bytes
    terms = []
    backward_s = compute_s * 2.0 / 3.0
    if z == 3:
        # forward and backward; the remat forward once more, but with the prefetch, whose
        # backward reruns each layer with the weights it gathered for it
        options = parallelism.options
        gathers = 2 + (1 if options.remat == "full" and not options.prefetch else 0)
        total = m * gathers * ring(F, g, bw_f, lat_f)
        what = (f"{m} microbatches x {gathers} all-gathers of the {g / 1e9:.3g} GB parameters "
                f"over fsdp={F} on {name_f}, prefetched behind the layers")  # fmt: skip
        window = compute_s * a.dp_overlap
        terms.append(exposed_term("fsdp_gather", total, window, overlap, what))
        used = min(total, window)  # the same link: the reduce-scatters get what is left
        total = m * ring(F, g, bw_f, lat_f) + ring(D, g / F, bw_d, lat_d, factor=2.0)
        what = (f"{m} microbatches x reduce-scatter of {g / 1e9:.3g} GB gradients over fsdp={F}, "
                "behind the backward compute the gathers leave free")  # fmt: skip
        window = max(0.0, min(backward_s * a.dp_overlap, window - used))
    else:
        if z <= 1:
            if F > 1 and D > 1:
                bw, lat = min(bw_d, bw_f), max(lat_d, lat_f)
            else:
                bw, lat = (bw_f, lat_f) if F > 1 else (bw_d, lat_d)
            total = ring(D * F, g, bw, lat, factor=2.0)
            what = f"all-reduce of {g / 1e9:.3g} GB gradients over data x fsdp={D * F}"
        elif m > 1 and parallelism.pipeline == 1 and a.zero2_scatter == "microbatch":
            # accumulate(zero=2): each microbatch's backward reduce-scatters its own
            # gradients (hidden behind that backward); the updated shards are
            # all-gathered after the optimizer step, with no compute beside them.
            gather = ring(F, g, bw_f, lat_f)
            terms.append(exposed_term(
                "fsdp_gather", gather, 0.0, overlap,
                f"all-gather of the {g / 1e9:.3g} GB updated parameters over fsdp={F} after "
                "the optimizer step",
            ))  # fmt: skip
            total = m * ring(F, g, bw_f, lat_f) + ring(D, g / F, bw_d, lat_d, factor=2.0)
            what = (f"{m} microbatches x reduce-scatter of {g / 1e9:.3g} GB gradients over "
                    f"fsdp={F}, each behind its microbatch's backward")  # fmt: skip
        else:
            total = 2 * ring(F, g, bw_f, lat_f) + ring(D, g / F, bw_d, lat_d, factor=2.0)
            what = f"reduce-scatter + all-gather of {g / 1e9:.3g} GB over fsdp={F}"
        if z == 2 and "each behind" in what:
            window = backward_s * a.dp_overlap
        else:
            window = backward_s / m * a.dp_overlap
            if m > 1:
                what += f", behind the last of {m} microbatches' backward"
    if D > 1 and z >= 2:
        what += f", all-reduce of the shards over data={D}"
    terms.append(exposed_term("data_parallel", total, window, overlap, what))
    return terms
