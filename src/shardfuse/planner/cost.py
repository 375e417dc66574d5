"""The analytic cost model: FLOPs, step time and memory of one training step, per device.

Every number is a named term with its formula (`Estimate.time`, `.memory`), so
a plan explains itself. Notation: B global batch (sequences), s sequence
length, L layers, h hidden, a query heads, k kv heads, d head dim, f MLP
hidden, V vocabulary; mesh sizes P pipeline, D data, F fsdp, E expert,
C sequence, T model; R = D F E replicas, mb sequences per microbatch, m
microbatches per replica, v virtual stages.

FLOPs: `shardfuse.flops`, the one definition (model FLOPs for MFU, PaLM and
Megatron's convention, no causal halving; hardware FLOPs with the remat
policy's recomputation and, with `Assumptions.causal_skip`, causal attention
charged its visible keys only; a mixture of experts its active weights).

Mixture of experts (issue 44): the routed experts' FLOPs (`Step.expert_flops`)
run at `Assumptions.grouped_matmul_efficiency` of the matmul rate, and below it
where their matmuls are memory-bound (`Step.expert_roofline`: small experts
split over `model`, few tokens per expert) (in `compute`); over an expert axis
E > 1 every device waits for the most loaded one (`expert_imbalance`:
`(imbalance - 1) x` the routed compute and the exposed all-to-alls, the
imbalance capped by a capacity factor) and the tokens travel by all-to-all
(`expert_parallel`, `comm.expert_parallel_term`); the expert weights are
sharded over E (and T), their optimizer state over F per ZeRO (`memory`).
Issue 45: the routed copies' permutation and combine are memory traffic
(`elementwise_term`, `moe_permute_h_passes`); a system that pads every expert to
its capacity (`Assumptions.expert_capacity_padded`) computes `capacity_factor x`
the routed work instead of waiting for the most loaded device; one that
recomputes the MoE blocks (`Assumptions.recompute_moe`) runs their grouped
matmuls, all-to-alls and permutation once more; a grouped matmul whose row tiles
are visited once per group (`Assumptions.grouped_matmul_row_tile`, megablox)
runs at its tile visits' efficiency (`Step.grouped_matmul_efficiency`). A capacity-padded
dense dispatch permutes nothing (its one-hot einsums are matmuls: two forward, three
backward), runs the experts' activation on the padded rows (`elementwise_term`), and its
experts are equal-sized batched einsums, not ragged grouped matmuls (no
`grouped_matmul_efficiency`: `Step.grouped_matmul_efficiency`).
An async pipeline's last stage runs the head (logits, loss) beside its layers, or in the
layer slot the split gives it (`Assumptions.loss_slot`): `pipeline_head`. A system whose MoE
layers run eager, host-bound (`Assumptions.moe_host_s`: Megatron-Core without CUDA graphs),
adds a fixed wait per MoE layer and microbatch: `moe_host`.

Step time = compute / (peak x efficiency) + memory-bound elementwise work
(norms, residuals, activations, and the softmax of materialised scores when
there is no flash attention, at HBM bandwidth) + exposed communication (every
collective: `comm`; a term's `total` is the whole collective, its value what
the overlap model leaves exposed) + the pipeline's recompute, sends and bubble
(`pipeline_time`). The efficiency and the overlap are per hardware generation
(`efficiency`, with their sources) unless `Assumptions` fixes them.
Pipelines run as the executor runs them: shardfuse's executor (the default
`Assumptions.pipeline_executor="lockstep"`) runs the schedule's lockstep
table, every stage one F and one B per tick, and reruns the stage forward in
every backward with `residuals="recompute"`: its time is the schedule IR's
`lockstep_work` (`pipeline_time`). "async" pipelines (Megatron, the
published runs' systems) pay the IR's closed-form bubble,
`closed_form_bubble`: (P - 1) / m of the pipelined work for GPipe and 1F1B,
(P - 1) / (v m) for the interleaved schedule and (P - 1) / (3 m) for ZB-H1.

Memory (per device, the most loaded pipeline stage): parameters, gradients
and optimizer state divided over F per ZeRO stage; activations per layer
and microbatch in the style of Korthikanti et al. 2022 (the tensors each
block keeps for its backward pass, divided by T with sequence parallelism
and by C), times the layers of a stage and the microbatches in flight
(the executor's lockstep table: GPipe m, 1F1B and ZB-H1 min(m, 2P - 1), interleaved its peak;
an async executor's: 1F1B min(m, P)): their stage inputs when the backward reruns the stage,
all their saved activations when the residuals are stored (Megatron);
one layer's working set in its backward pass (its activations, recomputed or
kept, and their cotangents); with tensor parallelism the full-sequence
buffers of the collective matmuls; the logits of one microbatch;
ZeRO-3's gathered layers; the step's outputs when the inputs are not donated.
"""

import dataclasses

from shardfuse import flops
from shardfuse.flops import mean_visible_keys as mean_visible_keys  # its old home
from shardfuse.hardware import Cluster
from shardfuse.model_spec import ModelSpec
from shardfuse.planner.comm import (
    context_parallel_term,
    data_parallel_terms,
    expert_parallel_term,
    exposed_term,
    tensor_parallel_term,
)
from shardfuse.planner.memory import memory_terms, params_per_device, saved_elements_per_token
from shardfuse.planner.options import MESH_AXES, Assumptions, Parallelism
from shardfuse.planner.pipeline_time import PIPELINED, pipeline_terms
from shardfuse.planner.step import Step
from shardfuse.planner.terms import Term
from shardfuse.ring_time import ring_bandwidth

# Elementwise traffic per token and layer, in h-sized tensors read or written (two
# norms: 2 x (h in, h out); two residual adds: 2 x (2h in, h out)), and per
# attention score without flash attention (QK^T out, softmax in/out, dropout mask,
# dropout out, AV in).
ELEMENTWISE_H_PASSES = 10
SOFTMAX_PASSES = 6


def moe_permute_h_passes(top_k: int) -> int:
    """h-sized tensors a mixture-of-experts block reads or writes per token beside its
    matmuls: the dispatch's permutation (the token's row in, its `top_k` copies sorted by
    expert out) and the combine's (the `top_k` expert outputs in, their weighted sum out):
    `2 (top_k + 1)`."""
    return 2 * (top_k + 1)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The cost of one parallelism: FLOPs, time and memory terms, and their totals.

    Attributes:
      model_flops: FLOPs of the step by the model (MFU numerator), all devices.
      hardware_flops: FLOPs the devices execute (recomputation, causal skip), all devices.
      time: step-time terms (seconds); `step_time_s` is their sum.
      memory: per-device memory terms (bytes); `memory_bytes` is their sum.
      step_time_s, memory_bytes: the totals.
      mfu: `model_flops / (devices * peak * step_time_s)`.
      tflops_per_device: `hardware_flops / devices / step_time_s / 1e12`.
      memory_limit_bytes: what fits: `(1 - reserved_fraction) * HBM`.
    """

    model_flops: float
    hardware_flops: float
    time: tuple[Term, ...]
    memory: tuple[Term, ...]
    step_time_s: float
    memory_bytes: float
    mfu: float
    tflops_per_device: float
    memory_limit_bytes: float

    @property
    def fits(self) -> bool:
        """`memory_bytes <= memory_limit_bytes`."""
        return self.memory_bytes <= self.memory_limit_bytes


def axis_link(cluster: Cluster, parallelism: Parallelism, axis: str) -> tuple[float, float, str]:
    """`(bytes/s, latency s, link name)` of the ring over mesh axis `axis`.

    Devices are laid out in `MESH_AXES` order (innermost fastest); an axis whose
    group `stride * size` fits in one node uses the intra-node link, in both
    directions where that adds bandwidth (a torus: two links, capped by the
    chip's egress); any other the inter-node link.

    Example:
      >>> from shardfuse import hardware
      >>> from shardfuse.planner.cost import axis_link
      >>> from shardfuse.planner.options import Parallelism
      >>> c = hardware.cluster("h100", nodes=2)
      >>> parallelism = Parallelism.of(data=2, model=8)
      >>> axis_link(c, parallelism, "model")[2], axis_link(c, parallelism, "data")[2]
      ('NVLink 4', 'InfiniBand NDR')
    """
    sizes = parallelism.mesh_shape
    stride = 1
    for inner in reversed(MESH_AXES):
        if inner == axis:
            break
        stride *= sizes[inner]
    span = stride * sizes[axis]
    per_node = cluster.devices_per_node
    inside = span <= per_node and per_node % span == 0
    link = cluster.intra_link if inside else cluster.inter_link
    bandwidth = ring_bandwidth(link.gb_per_s, link.egress_gb_per_s, bidirectional=inside)
    return bandwidth, link.latency_us * 1e-6, link.name


def compute_term(step: Step) -> Term:
    """The matmuls and attention cores: the step's hardware FLOPs at the rates they reach.

    What the search's bound reads too: it is the same for every mesh of a cluster, but for
    a mixture of experts' roofline (`Step.expert_roofline`), which the bound takes at 1.
    """
    n, rate, attention_flops = step.n, step.rate, step.attention_flops
    expert_flops = step.expert_flops
    dense = step.hardware_flops - attention_flops - expert_flops
    compute = dense / n / rate + attention_flops / n / step.attention_rate
    if expert_flops:
        compute += step.expert_s
    peak = step.peak_flops / 1e12
    attention = ""
    if step.attention_rate != rate:
        attention = (
            f"; the {attention_flops:.3e} of attention at "
            f"{step.attention_rate / step.peak_flops:.3g}"
        )
    if expert_flops:
        attention += (
            f"; the {expert_flops:.3e} of the routed experts' grouped matmuls at "
            f"{step.grouped_matmul_efficiency:.3g} x the matmul efficiency x roofline "
            f"{step.expert_roofline:.3g}"
        )
    return Term(
        "compute",
        compute,
        f"{step.hardware_flops:.3e} hardware FLOPs / {n} devices / ({peak:g} TFLOP/s x "
        f"{step.efficiency:.3g} matmul efficiency of {step.cluster.device.name}{attention})",
    )


def elementwise_term(step: Step) -> Term:
    """Memory-bound elementwise work (norms, residual adds, activation, and the softmax over
    materialised scores without flash attention; in a mixture of experts the permutation of
    the routed copies and their combine, `moe_permute_h_passes`): each op reads and writes
    its tensors once per pass; backward ~2 passes, a recomputed forward 1 more (the MoE
    blocks' too under `Assumptions.recompute_moe`). A capacity-padded dense dispatch
    (`Assumptions.expert_capacity_padded`) permutes nothing (its einsums are matmuls) and
    runs the routed experts' activation on `capacity_factor x` the routed rows."""
    model, a, T = step.model, step.a, step.T
    act = a.activation_bytes
    token_split = T if a.sequence_parallel else 1
    width = model.mlp_width()
    capacity = step.parallelism.options.capacity_factor
    padded = bool(model.moe_layers) and a.expert_capacity_padded and capacity is not None
    if padded:  # the routed experts' activation runs on their capacity-padded buffers
        moe_fraction = len(model.moe_layers) / model.num_layers
        width += (capacity - 1) * moe_fraction * model.top_k * model.expert_ffn_hidden
    mlp_io = model.mlp_matrices * width / T  # gated: gate, up and their product
    traffic = (ELEMENTWISE_H_PASSES * model.hidden / token_split + mlp_io) * act
    if not a.flash_attention:
        traffic += model.heads / T * step.visible * SOFTMAX_PASSES * act
    passes = 3 + (1 if step.reruns_forward else 0)
    # The routed copies' permutation and the weighted combine; a capacity-padded dense
    # dispatch has none: its one-hot einsums (matmuls, `Step.hardware_flops`) place the
    # copies and sum them back.
    if model.moe_layers and not padded:
        moe_fraction = len(model.moe_layers) / model.num_layers
        moe_passes = 3 + (1 if step.reruns_moe else 0)
        moe_split = a.moe_token_split(T)
        traffic += (
            (moe_fraction * moe_permute_h_passes(model.top_k) * model.hidden / moe_split * act)
            * moe_passes
            / passes
        )
    hbm = step.cluster.device.hbm_gb_per_s * 1e9
    token_layers = step.tokens / (step.D * step.F * step.E * step.C * step.P) * model.num_layers
    return Term(
        "elementwise",
        token_layers * traffic * passes / hbm,
        f"{traffic / 1e3:.4g} kB per token and layer x {passes} passes x "
        f"{token_layers:.4g} token-layers / {hbm / 1e9:g} GB/s HBM",
    )


def tensor_parallel(step: Step) -> Term:
    """The tensor-parallel collectives over `model` (`comm.tensor_parallel_term`)."""
    term, _ = tensor_parallel_term(
        T=step.T, mb=step.mb, s=step.s, C=step.C, h=step.model.hidden,
        act=step.a.activation_bytes, layer_microbatches=step.m * step.layers_dev,
        reruns_forward=step.reruns_forward, link=axis_link(step.cluster, step.parallelism, "model"),
        matmul_s=step.matmul_s, a=step.a, overlap=step.overlap,
    )  # fmt: skip
    return term


def context_parallel(step: Step) -> Term:
    """Context-parallel attention's traffic over `sequence` (`comm.context_parallel_term`)."""
    return context_parallel_term(
        step.model, step.parallelism, step.a, mb_tokens=step.mb_tokens,
        layer_microbatches=step.m * step.layers_dev, reruns_forward=step.reruns_forward,
        link=axis_link(step.cluster, step.parallelism, "sequence"),
        attention_s=step.attention_s, overlap=step.overlap,
    )  # fmt: skip


def moe_layers_of_stage(step: Step) -> float:
    """MoE blocks of the fullest pipeline stage: its layers x the model's MoE fraction."""
    model = step.model
    return step.layers_dev * len(model.moe_layers) / model.num_layers


def axis_in_node(cluster: Cluster, parallelism: Parallelism, axis: str) -> int:
    """Members of a group over mesh axis `axis` that share one node (devices laid out as
    `axis_link` lays them out).

    Example:
      >>> from shardfuse import hardware
      >>> from shardfuse.planner.cost import axis_in_node
      >>> from shardfuse.planner.options import Parallelism
      >>> c = hardware.cluster("h100", nodes=4)
      >>> axis_in_node(c, Parallelism.of(expert=16, model=2), "expert")
      4
    """
    sizes = parallelism.mesh_shape
    stride = 1
    for inner in reversed(MESH_AXES):
        if inner == axis:
            break
        stride *= sizes[inner]
    per_node = cluster.devices_per_node
    if per_node % stride:
        return 1
    return max(1, min(sizes[axis], per_node // stride))


def moe_tokens(step: Step) -> float:
    """Tokens one device routes and dispatches per MoE block and microbatch: the
    microbatch's `mb_tokens`, over `model` only where the dispatch starts from the
    sequence-parallel shards (`Assumptions.moe_token_split`)."""
    return step.mb_tokens / step.a.moe_token_split(step.T)


def expert_parallel(step: Step) -> Term:
    """The dispatch and combine all-to-alls over `expert` (`comm.expert_parallel_term`)."""
    model, a, cluster = step.model, step.a, step.cluster
    intra = ring_bandwidth(cluster.intra_link.gb_per_s, cluster.intra_link.egress_gb_per_s,
                           bidirectional=True)  # fmt: skip
    inter = ring_bandwidth(cluster.inter_link.gb_per_s, cluster.inter_link.egress_gb_per_s,
                           bidirectional=False)  # fmt: skip
    links = ((intra, cluster.intra_link.latency_us * 1e-6, cluster.intra_link.name),
             (inter, cluster.inter_link.latency_us * 1e-6, cluster.inter_link.name))  # fmt: skip
    term, _ = expert_parallel_term(
        E=step.E, in_node=axis_in_node(cluster, step.parallelism, "expert"),
        tokens=moe_tokens(step), model=model, act=a.activation_bytes,
        moe_layer_microbatches=step.m * moe_layers_of_stage(step),
        reruns_forward=step.reruns_moe, links=links, expert_s=step.expert_s, a=a,
        overlap=step.overlap,
    )  # fmt: skip
    return term


def expert_imbalance(step: Step, all_to_all_s: float = 0.0) -> Term:
    """Over an expert axis the step waits for the most loaded device: `(imbalance - 1) x` the
    routed experts' compute and the exposed dispatch and combine all-to-alls `all_to_all_s`
    (the busiest device receives, and sends back, the most rows), the imbalance
    `Assumptions.expert_imbalance` capped by the run's `capacity_factor` (a device computes
    at most its capacity). Where the system pads every expert to its capacity
    (`Assumptions.expert_capacity_padded`) every device computes and exchanges
    `capacity_factor x` the balanced routed rows, expert axis or not: `(capacity_factor -
    1) x` the same (none below 1)."""
    imbalance = step.a.expert_imbalance
    capacity = step.parallelism.options.capacity_factor
    why = f"expert_imbalance {imbalance:g}"
    work = step.expert_s + all_to_all_s
    what = f"{step.expert_s:.3g} s of routed expert compute"
    if all_to_all_s:
        what += f" + {all_to_all_s:.3g} s of exposed all-to-alls"
    if capacity is not None and step.a.expert_capacity_padded:
        return Term(
            "expert_imbalance",
            max(0.0, capacity - 1) * work,
            f"(capacity_factor {capacity:g} - 1) x ({what}): every expert padded to its "
            "capacity (dense dispatch)",
        )
    if capacity is not None and capacity < imbalance:
        imbalance, why = max(1.0, capacity), f"capacity_factor {capacity:g} (dropping tokens)"
    return Term(
        "expert_imbalance",
        (imbalance - 1) * work,
        f"({why} - 1) x ({what}) over expert={step.E}",
    )


def moe_host(step: Step) -> Term:
    """The GPU waiting on the host in every MoE layer: `m x` the MoE layers of the fullest
    stage `x Assumptions.moe_host_s`, the host time per layer and microbatch (forward and
    backward) that an eager MoE layer adds: its many small kernels launched one by one,
    after the device-to-host copy of the token counts that drains the GPU's queue
    (`efficiency.MEGATRON_MOE_HOST_S`, its sources). Per microbatch, not per token: the
    kernels launched, not the rows, set it. A stage term (`pipeline_time.PIPELINED`): the
    bubble charges it too."""
    layers = moe_layers_of_stage(step)
    host = step.m * layers * step.a.moe_host_s
    return Term(
        "moe_host", host,
        f"{step.m} microbatches x {layers:g} MoE layers of the fullest stage x "
        f"{step.a.moe_host_s * 1e3:.3g} ms of host work a layer (moe_host_s, eager MoE layers)",
    )  # fmt: skip


def offload(step: Step, per_token: dict, compute_s: float) -> Term:
    """remat="offload": the saved activations to the host and back, beside the compute."""
    a, L = step.a, step.model.num_layers
    moved = 2 * step.tokens / step.n * L * (per_token["full_layer"] - per_token["saved"])
    moved = moved * a.activation_bytes
    t_host = moved / (a.offload_gb_per_s * 1e9)
    what = f"{moved / 1e9:.3g} GB to the host and back at {a.offload_gb_per_s:g} GB/s"
    return exposed_term("offload", t_host, compute_s, step.overlap, what)


def pipeline(step: Step, terms: list) -> list:
    """The pipeline's terms (`pipeline_time`): uneven stages' imbalance, its recompute,
    sends and bubble; `terms` the step's terms so far (the stage work among them)."""
    model, a, T, P, L = step.model, step.a, step.T, step.P, step.model.num_layers
    mb_tokens, layers_dev = step.mb_tokens, step.layers_dev
    head_s = flops.TRAINING_OVER_FORWARD * flops.logits_flops(model) * mb_tokens / T / step.rate
    send = mb_tokens * model.hidden * a.activation_bytes / (T if a.sequence_parallel else 1)
    out = []
    if layers_dev * P != L:  # uneven stages: every tick runs as long as the fullest one
        work = sum(t.value for t in terms if t.name in PIPELINED)
        out.append(Term(
            "pipeline_imbalance", (layers_dev * P / L - 1) * work,
            f"{L} layers over {P} stages, the fullest {layers_dev:g} "
            f"(sf.parallel.balance_stages): ({layers_dev:g} x {P} / {L} - 1) x the stage "
            f"work {work:.3g} s",
        ))  # fmt: skip
    if a.pipeline_executor == "async":
        head = pipeline_head(step, terms, head_s)
        if head is not None:
            out.append(head)
    out += pipeline_terms(
        step.parallelism, a, terms + out, head_s=head_s, send_bytes=send, overlap=step.overlap,
        link=axis_link(step.cluster, step.parallelism, "pipeline"),
    )  # fmt: skip
    return out


def pipeline_head(step: Step, terms: list, head_s: float) -> Term | None:
    """The head (logits, loss and their backward) runs on the last pipeline stage only.

    `compute_term` spreads the head's FLOPs over every device (`1 / P` of a replica's head
    on each stage); in an async pipeline (Megatron's) the last stage runs all of it beside
    its layers, and in the steady state every stage waits for the slowest. The last stage
    works `m x head_s x (1 - 1 / P)` more than the others; where the pipeline split gives
    the head one layer slot (`Assumptions.loss_slot`: Megatron's
    `--account-for-loss-in-pipeline-split`, Llama 3's last stage one layer short) that
    stage holds one layer fewer than the planned `layers_dev`, and the excess is the head
    less one layer's stage work (none where the head is lighter than a layer). The
    lockstep executor charges the head in its table (`pipeline_time`). None when nothing
    is left over."""
    m, P, layers = step.m, step.P, step.layers_dev
    head = m * head_s
    spread = head / P  # what compute_term already charges every stage
    work = sum(t.value for t in terms if t.name in PIPELINED)
    layer = (work - spread) / layers if step.a.loss_slot else 0.0
    extra = head - spread - layer
    if extra <= 0:
        return None
    slot = f" less one layer's stage work {layer:.3g} s (the loss slot)" if layer else ""
    return Term(
        "pipeline_head", extra,
        f"the head on the last of {P} stages: {m} microbatches x {head_s:.3g} s x (1 - 1/{P})"
        f"{slot}: {extra:.3g} s beside the stage work {work:.3g} s",
    )  # fmt: skip


def data_parallel(step: Step, params_dev: float, compute_s: float) -> list:
    """ZeRO-3's gathers and the gradient reduction over `data` and `fsdp` (`comm`).

    The expert axis splits the batch too: the gradients are reduced over data x
    expert (the slower of their links) and fsdp. (The routed experts' own gradients
    need no reduction over `expert`; counted with the rest, a small overestimate.)
    """
    parallelism = step.parallelism
    links = [axis_link(step.cluster, parallelism, axis) for axis in ("data", "fsdp")]
    if step.E > 1:
        expert_link = axis_link(step.cluster, parallelism, "expert")
        links[0] = expert_link if step.D == 1 else min(links[0], expert_link)
        parallelism = parallelism.replace(data=step.D * step.E, expert=1)
    return data_parallel_terms(
        parallelism=parallelism, params_dev=params_dev, a=step.a, compute_s=compute_s,
        overlap=step.overlap, links=tuple(links),
    )  # fmt: skip


def optimizer_term(step: Step, params_dev: float) -> Term:
    """The optimizer update, memory-bound: Adam reads the gradient, the master weights and
    both moments and writes the last three and the weights the step reads, once per step,
    on this device's ZeRO shard."""
    a = step.a
    shard = step.F if step.parallelism.options.zero >= 1 else 1
    touched = a.grad_bytes + 2 * a.optimizer_bytes + a.param_bytes
    hbm = step.cluster.device.hbm_gb_per_s * 1e9
    return Term("optimizer", params_dev / shard * touched / hbm, f"{params_dev:.4g} params / "
                f"{shard} x {touched} B read and written / {hbm / 1e9:g} GB/s HBM")  # fmt: skip


def estimate(
    model: ModelSpec,
    cluster: Cluster,
    parallelism: Parallelism,
    *,
    global_batch: int,
    seq_len: int,
    assumptions: Assumptions | None = None,
) -> Estimate:
    """FLOPs, step time and memory of one training step of `model` under `parallelism`.

    The step time is the sum of the named terms of the module docstring, each
    one function of the step's `Step` (its sizes and rates, derived once):
    `compute_term`, `elementwise_term`, `tensor_parallel` (T > 1),
    `context_parallel` (C > 1), `expert_parallel` and `expert_imbalance` (a mixture
    of experts over E > 1), `moe_host` (eager MoE layers, `Assumptions.moe_host_s`),
    `offload` (remat "offload"), `pipeline` (P > 1),
    `data_parallel` (D x F x E > 1) and `optimizer_term`; the memory is
    `memory.memory_terms`.

    Args:
      model: the transformer.
      cluster: the devices (their count must equal `parallelism.num_devices`).
      parallelism: the mesh sizes and options.
      global_batch: sequences per step (B).
      seq_len: tokens per sequence (s).
      assumptions: efficiency, precision and overlap (default `Assumptions()`).

    Returns:
      The `Estimate`, every term named.

    Raises:
      ValueError: the parallelism's device count differs from the cluster's.

    Example:
      >>> from shardfuse import hardware, models
      >>> from shardfuse.planner.cost import estimate
      >>> from shardfuse.planner.options import Parallelism
      >>> e = estimate(models.get("llama3-8b"), hardware.cluster("h100"), Parallelism.of(fsdp=8,
      ...              zero=3, remat="full", num_microbatches=2), global_batch=16, seq_len=4096)
      >>> 0 < e.mfu < 1, e.fits
      (True, True)
    """
    step = Step.of(model, cluster, parallelism, global_batch=global_batch, seq_len=seq_len,
                   assumptions=assumptions)  # fmt: skip
    return step_estimate(step)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The memory half of an estimate (`step_memory`), which `step_estimate` completes.

    Attributes:
      per_token: `memory.saved_elements_per_token` of the step.
      params_dev: `memory.params_per_device` of the step.
      terms: the memory `Term`s (`memory.memory_terms`); `memory_bytes` their sum.
      memory_limit_bytes: what fits: `(1 - reserved_fraction) * HBM`.
    """

    per_token: dict
    params_dev: float
    terms: tuple[Term, ...]
    memory_bytes: float
    memory_limit_bytes: float

    @property
    def fits(self) -> bool:
        """`memory_bytes <= memory_limit_bytes` (as `Estimate.fits`)."""
        return self.memory_bytes <= self.memory_limit_bytes


def step_memory(step: Step) -> StepMemory:
    """The memory terms of `step`: what decides whether it fits, before any time term (the
    search drops what does not fit without pricing its time)."""
    model, parallelism, a = step.model, step.parallelism, step.a
    per_token = saved_elements_per_token(model, parallelism, a, step.s)
    params_dev = params_per_device(model, parallelism, a)
    memory = memory_terms(model, parallelism, a, params_dev, per_token, step.mb_tokens,
                          step.layers_dev, step.s)  # fmt: skip
    return StepMemory(
        per_token=per_token,
        params_dev=params_dev,
        terms=tuple(memory),
        memory_bytes=sum(t.value for t in memory),
        memory_limit_bytes=step.cluster.device.hbm_gb * 1e9 * (1 - a.reserved_fraction),
    )


def step_estimate(step: Step, memory: StepMemory | None = None) -> Estimate:
    """`estimate` of a `Step`; `memory`: its `step_memory`, when already computed."""
    model, parallelism, a = step.model, step.parallelism, step.a
    memory = memory or step_memory(step)
    per_token, params_dev = memory.per_token, memory.params_dev
    compute = compute_term(step)
    time = [compute, elementwise_term(step)]
    if step.T > 1:
        time.append(tensor_parallel(step))
    if step.C > 1:
        time.append(context_parallel(step))
    if step.E > 1 and model.moe_layers:
        all_to_all = expert_parallel(step)
        time += [all_to_all, expert_imbalance(step, all_to_all.value)]
    elif (model.moe_layers and a.expert_capacity_padded
          and parallelism.options.capacity_factor is not None):  # fmt: skip
        time.append(expert_imbalance(step))
    if model.moe_layers and a.moe_host_s:
        time.append(moe_host(step))
    if parallelism.options.remat == "offload":
        time.append(offload(step, per_token, compute.value))
    if step.P > 1:
        time += pipeline(step, time)
    if step.D * step.F * step.E > 1:
        time += data_parallel(step, params_dev, compute.value)
    time.append(optimizer_term(step, params_dev))
    step_time = sum(t.value for t in time)
    model_flops = flops.model_flops(model, seq_len=step.s, batch=step.B)
    n = step.n
    return Estimate(
        model_flops=model_flops,
        hardware_flops=step.hardware_flops,
        time=tuple(time),
        memory=memory.terms,
        step_time_s=step_time,
        memory_bytes=memory.memory_bytes,
        mfu=flops.mfu(
            model_flops, step_time_s=step_time, devices=n, peak_flops_per_s=step.peak_flops
        ),  # fmt: skip
        tflops_per_device=step.hardware_flops / n / step_time / 1e12,
        memory_limit_bytes=memory.memory_limit_bytes,
    )
