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
- expert_parallel (a mixture of experts over `expert` = EP > 1): per MoE block and
  microbatch, the dispatch all-to-all (each routed copy of a token to its
  expert's device) and the combine (the expert outputs back): each device sends
  `routed tokens x h x bytes x (EP - 1) / EP` per all-to-all, routed tokens =
  `top_k x` its tokens (over `model` with sequence parallelism): `2 x` that
  forward, the same backward (the transposed all-to-alls of the cotangents), and
  again when the backward reruns the forward (remat "full"). An all-to-all
  over a switch is limited by each device's egress; a group spanning nodes
  sends its copies for the node's other members over the node's links and the
  rest over the network at once, the slower setting the time (with
  `Assumptions.ep_node_dedup`, DeepEP, one copy per remote node). Exposed
  unless `Assumptions.ep_overlap` (then hidden behind the expert compute).
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


def all_to_all_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds of one all-to-all over `n` devices of a `nbytes` buffer per device: it sends
    `(n - 1) / n` of it, at the link's bandwidth, in one latency.

    Example:
      >>> from shardfuse.planner.comm import all_to_all_s
      >>> all_to_all_s(4, 4e9, 1e9, 0.5), all_to_all_s(1, 4e9, 1e9, 0.5)
      (3.5, 0.0)
    """
    if n <= 1:
        return 0.0
    return nbytes * (n - 1) / n / bandwidth + latency


def remote_node_copies(top_k: int, experts: int, nodes: int, *, dedup: bool) -> float:
    """Copies of one token that cross the network in a dispatch over an expert group of
    `nodes` nodes (the experts spread evenly; the token's own node holds `1 / nodes`).

    Without `dedup` every routed copy whose expert sits on another node: `top_k x (nodes -
    1) / nodes`. With it (DeepEP) one copy per remote node holding at least one of its
    `top_k` experts (drawn without replacement, uniformly): `(nodes - 1) x (1 - P(none of
    a node's experts))`.

    Example:
      >>> from shardfuse.planner.comm import remote_node_copies
      >>> remote_node_copies(8, 128, 4, dedup=False)
      6.0
      >>> round(remote_node_copies(8, 128, 4, dedup=True), 2)
      2.72
    """
    if nodes <= 1:
        return 0.0
    if not dedup:
        return top_k * (nodes - 1) / nodes
    per_node = experts / nodes
    missed = 1.0
    for i in range(top_k):
        missed *= max(0.0, experts - per_node - i) / (experts - i)
    return (nodes - 1) * (1 - missed)


def expert_parallel_term(*, E, in_node, tokens, model, act, moe_layer_microbatches,
                         reruns_forward, links, expert_s, a, overlap):  # fmt: skip
    """The dispatch and combine all-to-alls over `expert` of the step (module docstring).

    One all-to-all moves each device's `tokens x top_k` routed copies of `[h]`: the
    copies for the `in_node - 1` other group members of its node over the node's link,
    the copies for other nodes (`remote_node_copies` per token) over the network; the
    two run at once, the slower sets the time, plus one latency.

    Args:
      E: the expert axis size; in_node: its members within one node.
      tokens: tokens one device routes per microbatch (`cost.moe_tokens`).
      model: the `ModelSpec` (top_k, experts, hidden).
      act: bytes per activation element.
      moe_layer_microbatches: MoE blocks of the fullest stage x microbatches.
      reruns_forward: the backward reruns the forward (one more dispatch and combine).
      links: `((bytes/s, latency, name) inside a node, the same across nodes)`.
      expert_s: the routed experts' compute beside which an overlapped all-to-all hides.
      a, overlap: the `Assumptions` and the hardware's overlap fraction.

    Returns:
      `(Term, per_layer_forward_bytes)`: the term, and the bytes one device sends per
      MoE block forward (`2 x tokens x top_k x h x act x (E - 1) / E`).
    """
    (bw_in, lat_in, name_in), (bw_out, lat_out, name_out) = links
    row = model.hidden * act
    k = model.top_k
    nodes = E // in_node
    local = tokens * k * row * (in_node - 1) / E
    remote = tokens * row * remote_node_copies(k, model.experts, nodes, dedup=a.ep_node_dedup)
    one = max(local / bw_in, remote / bw_out if remote else 0.0) + (lat_out if remote else lat_in)
    all_to_alls = 4 + (2 if reruns_forward else 0)
    total = moe_layer_microbatches * all_to_alls * one
    window = expert_s if a.ep_overlap else 0.0
    where = f"on {name_in}" if nodes == 1 else (
        f"over {nodes} nodes: {local / 1e6:.3g} MB on {name_in}, {remote / 1e6:.3g} MB on "
        f"{name_out}" + (" (one copy per remote node)" if a.ep_node_dedup else "")
    )  # fmt: skip
    what = (f"{moe_layer_microbatches:g} MoE layer-microbatches x {all_to_alls} all-to-alls "
            f"(dispatch, combine; forward and backward) of [{tokens * k:g}, {model.hidden}] "
            f"over expert={E} {where}")  # fmt: skip
    forward_bytes = 2 * tokens * k * row * (E - 1) / E
    return exposed_term("expert_parallel", total, window, overlap, what), forward_bytes


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
