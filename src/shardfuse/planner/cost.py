"""The analytic cost model: FLOPs, step time and memory of one training step, per device.

Every number is a named term with its formula (`Estimate.time`, `.memory`), so
a plan explains itself. Notation: B global batch (sequences), s sequence
length, L layers, h hidden, a query heads, k kv heads, d head dim, f MLP
hidden, V vocabulary; mesh sizes P pipeline, D data, F fsdp, C sequence,
T model; R = D F replicas, mb sequences per microbatch, m microbatches per
replica, v virtual stages.

FLOPs: `shardfuse.flops`, the one definition (model FLOPs for MFU, PaLM and
Megatron's convention, no causal halving; hardware FLOPs with the remat
policy's recomputation and, with `Assumptions.causal_skip`, causal attention
charged its visible keys only).

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
(the executor's lockstep table: GPipe m, 1F1B and ZB-H1 min(m, 2P - 1), interleaved its peak);
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
from shardfuse.planner.comm import data_parallel_terms, exposed_term, tensor_parallel_term
from shardfuse.planner.efficiency import attention_efficiency
from shardfuse.planner.memory import (
    memory_terms,
    params_per_device,
    saved_elements_per_token,
    slowest_stage_layers,
)
from shardfuse.planner.options import MESH_AXES, Assumptions, Parallelism
from shardfuse.planner.pipeline_time import PIPELINED, pipeline_terms
from shardfuse.planner.terms import Term
from shardfuse.ring_time import ring_bandwidth, ring_collective_s, ring_transfer_s

# Elementwise traffic per token and layer, in h-sized tensors read or written (two
# norms: 2 x (h in, h out); two residual adds: 2 x (2h in, h out)), and per
# attention score without flash attention (QK^T out, softmax in/out, dropout mask,
# dropout out, AV in).
ELEMENTWISE_H_PASSES = 10
SOFTMAX_PASSES = 6


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
    a = assumptions or Assumptions()
    if parallelism.num_devices != cluster.num_devices:
        raise ValueError(
            f"parallelism {parallelism.mesh_shape} has {parallelism.num_devices} devices, "
            f"the cluster {cluster.num_devices}"
        )
    n = cluster.num_devices
    P, D, F, C, T = (
        parallelism.pipeline,
        parallelism.data,
        parallelism.fsdp,
        parallelism.sequence,
        parallelism.model,
    )
    mb, m = parallelism.microbatch_size, parallelism.options.num_microbatches
    h, L = model.hidden, model.num_layers
    B, s = global_batch, seq_len
    peak_flops = flops.peak_flops_per_s(cluster.device, a.compute_dtype)
    peak = peak_flops / 1e12
    efficiency = a.efficiency_for(cluster.device)
    overlap = a.overlap_for(cluster.device)
    rate = peak_flops * efficiency

    # ---- FLOPs (shardfuse.flops) ----
    visible = mean_visible_keys(s, model.window, a.causal_skip)
    tokens = B * s
    model_flops = flops.model_flops(model, seq_len=s, batch=B)
    hardware_flops = flops.hardware_flops(
        model, seq_len=s, batch=B, remat=parallelism.options.remat, causal_skip=a.causal_skip
    )
    # Attention cores run as flash-attention kernels (their own efficiency) or, without
    # flash attention, as batched matmuls; recomputed once more under "full",
    # "selective" and "offload" remat.
    attention_hw = flops.layer_attention_flops(model, s, causal_skip=a.causal_skip)
    reruns = 1 if parallelism.options.remat in ("full", "selective", "offload") else 0
    attention_flops = (flops.TRAINING_OVER_FORWARD + reruns) * tokens * L * attention_hw
    attention_rate = rate
    if a.flash_attention and a.compute_efficiency is None:
        attention_rate = peak_flops * attention_efficiency(cluster.device)
    compute = (hardware_flops - attention_flops) / n / rate + attention_flops / n / attention_rate
    layers_dev = slowest_stage_layers(model, parallelism)  # L / P, or the balancer's fullest stage
    training = flops.TRAINING_OVER_FORWARD
    # forward + backward matmuls and attention cores
    matmul_time = training * tokens * L * flops.layer_matmul_flops(model) / n / rate
    attention_time = training * tokens * L * attention_hw / n / attention_rate

    # ---- communication ----
    act = a.activation_bytes
    mb_tokens = mb * s / C  # tokens of one microbatch on one device (before the model axis)
    time_terms = [
        Term(
            "compute",
            compute,
            f"{hardware_flops:.3e} hardware FLOPs / {n} devices / ({peak:g} TFLOP/s x "
            f"{efficiency:.3g} matmul efficiency of {cluster.device.name}"
            + (
                f"; the {attention_flops:.3e} of attention at {attention_rate / peak_flops:.3g}"
                if attention_rate != rate
                else ""
            )
            + ")",
        )
    ]
    layer_microbatches = m * layers_dev
    if T > 1:
        tp_term, tp_collectives = tensor_parallel_term(
            T=T, mb=mb, s=s, C=C, h=h, act=act, layer_microbatches=layer_microbatches,
            remat=parallelism.options.remat, link=axis_link(cluster, parallelism, "model"),
            matmul_s=matmul_time, a=a, overlap=overlap,
        )  # fmt: skip
        time_terms.append(tp_term)
    if C > 1:
        bw, lat, name = axis_link(cluster, parallelism, "sequence")
        kv_heads = max(model.kv_heads / T, 1.0)
        kv_bytes = mb_tokens * kv_heads * model.head_dim * 2 * act
        strategy = parallelism.cp_strategy
        if strategy == "ulysses":
            q_bytes = mb_tokens * model.heads / T * model.head_dim * act
            local = 2 * q_bytes + kv_bytes  # q, out and k, v
            cp = layer_microbatches * 2 * ring_collective_s(C, local, bw, lat)
            window = 0.0
        else:  # ring, ulysses_ring (modelled as ring), all_gather
            hops = 3 + (1 if parallelism.options.remat == "full" else 0)
            cp = layer_microbatches * hops * ring_transfer_s(C, kv_bytes, bw, lat)
            overlapped = a.cp_overlap and strategy != "all_gather"
            window = (C - 1) / C * attention_time if overlapped else 0.0
        what = f"{strategy} attention over sequence={C} on {name}: K/V traffic"
        time_terms.append(exposed_term("context_parallel", cp, window, overlap, what))
    per_token = saved_elements_per_token(model, parallelism, a, s)
    # Memory-bound elementwise work (norms, residual adds, activation, and the
    # softmax over materialised scores without flash attention): each op reads
    # and writes its tensors once per pass; backward ~2 passes, recompute 1 more.
    token_split = T if a.sequence_parallel else 1
    mlp_io = (3 if model.activation == "swiglu" else 2) * model.ffn_hidden / T
    traffic = (ELEMENTWISE_H_PASSES * h / token_split + mlp_io) * act
    if not a.flash_attention:
        traffic += model.heads / T * visible * SOFTMAX_PASSES * act
    passes = 3 + (1 if parallelism.options.remat == "full" else 0)
    hbm = cluster.device.hbm_gb_per_s * 1e9
    elementwise = tokens / (D * F * C * P) * L * traffic * passes / hbm
    time_terms.insert(
        1,
        Term(
            "elementwise",
            elementwise,
            f"{traffic / 1e3:.4g} kB per token and layer x {passes} passes x "
            f"{tokens / (D * F * C * P) * L:.4g} token-layers / {hbm / 1e9:g} GB/s HBM",
        ),
    )
    if parallelism.options.remat == "offload":
        moved = 2 * tokens / n * L * (per_token["full_layer"] - per_token["saved"]) * act
        t_host = moved / (a.offload_gb_per_s * 1e9)
        what = f"{moved / 1e9:.3g} GB to the host and back at {a.offload_gb_per_s:g} GB/s"
        time_terms.append(exposed_term("offload", t_host, compute, overlap, what))
    if P > 1:
        head_s = flops.TRAINING_OVER_FORWARD * flops.logits_flops(model) * mb_tokens / T / rate
        send = mb_tokens * h * act / (T if a.sequence_parallel else 1)
        if layers_dev * P != L:  # uneven stages: every tick runs as long as the fullest one
            work = sum(t.value for t in time_terms if t.name in PIPELINED)
            time_terms.append(Term(
                "pipeline_imbalance", (layers_dev * P / L - 1) * work,
                f"{L} layers over {P} stages, the fullest {layers_dev:g} "
                f"(sf.parallel.balance_stages): ({layers_dev:g} x {P} / {L} - 1) x the stage "
                f"work {work:.3g} s",
            ))  # fmt: skip
        time_terms += pipeline_terms(
            parallelism, a, time_terms, head_s=head_s, send_bytes=send, overlap=overlap,
            link=axis_link(cluster, parallelism, "pipeline"),
        )  # fmt: skip
    params_dev = params_per_device(model, parallelism, a)
    if D * F > 1:
        time_terms += data_parallel_terms(
            parallelism=parallelism, params_dev=params_dev, a=a, compute_s=compute,
            overlap=overlap,
            links=tuple(axis_link(cluster, parallelism, axis) for axis in ("data", "fsdp")),
        )  # fmt: skip
    # The optimizer update is memory-bound: Adam reads the gradient, the master
    # weights and both moments and writes the last three and the weights the step
    # reads, once per step, on this device's ZeRO shard.
    shard = F if parallelism.options.zero >= 1 else 1
    touched = a.grad_bytes + 2 * a.optimizer_bytes + a.param_bytes
    update = params_dev / shard * touched / hbm
    time_terms.append(Term("optimizer", update, f"{params_dev:.4g} params / {shard} x {touched} "
                           f"B read and written / {hbm / 1e9:g} GB/s HBM"))  # fmt: skip
    step_time = sum(t.value for t in time_terms)

    # ---- memory ----
    memory = memory_terms(model, parallelism, a, params_dev, per_token, mb_tokens, layers_dev, s)
    memory_bytes = sum(t.value for t in memory)
    limit = cluster.device.hbm_gb * 1e9 * (1 - a.reserved_fraction)
    return Estimate(
        model_flops=model_flops,
        hardware_flops=hardware_flops,
        time=tuple(time_terms),
        memory=tuple(memory),
        step_time_s=step_time,
        memory_bytes=memory_bytes,
        mfu=flops.mfu(model_flops, step_time_s=step_time, devices=n, peak_flops_per_s=peak_flops),
        tflops_per_device=hardware_flops / n / step_time / 1e12,
        memory_limit_bytes=limit,
    )
