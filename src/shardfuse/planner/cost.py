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
there is no flash attention, at HBM bandwidth) + exposed communication +
pipeline bubble. Collectives are ring algorithms on the link the mesh axis maps to
(an axis whose devices share a node uses the intra-node link, any other the
inter-node one): all-gather and reduce-scatter move (n - 1) / n of the full
buffer, all-reduce twice that, plus (n - 1) link latencies. Tensor
parallelism (Megatron with sequence parallelism): 4 all-gathers/reduce-
scatters of the `[mb, s / C, h]` activation per layer forward, 4 backward, 4
more when "full" remat recomputes the forward; hidden behind (T - 1) / T of
the layer's matmuls when they run as collective-matmul rings (the ring
schedule of `collectives.collective_matmul`). Ring attention sends K/V
C - 1 times forward and (K/V and dK/dV) 2 (C - 1) times backward, hidden
behind (C - 1) / C of the attention compute. Data parallelism all-reduces
the gradients (ZeRO-0/1), reduce-scatters them over F (ZeRO-2, then
all-gathers the updated parameters), or gathers the parameters every
microbatch forward and backward (ZeRO-3). The pipeline bubble is
(P - 1) / m of the pipelined work for GPipe and 1F1B, (P - 1) / (v m) for the
interleaved schedule and (P - 1) / (3 m) for ZB-H1 (Qi et al. 2023).

Memory (per device, the most loaded pipeline stage): parameters, gradients
and optimizer state divided over F per ZeRO stage; activations per layer
and microbatch in the style of Korthikanti et al. 2022 (the tensors each
block keeps for its backward pass, divided by T with sequence parallelism
and by C), times the layers of a stage and the microbatches in flight
(GPipe m, 1F1B and ZB-H1 min(m, P), interleaved min(m, P) (1 + (P - 1) / (P v)));
one layer's working set in its backward pass (its activations, recomputed or
kept, and their cotangents); with tensor parallelism the full-sequence
buffers of the collective matmuls; the logits of one microbatch;
ZeRO-3's gathered layers; the step's outputs when the inputs are not donated.
"""

import dataclasses

from shardfuse import flops
from shardfuse.flops import mean_visible_keys as mean_visible_keys  # its old home
from shardfuse.hardware import Cluster
from shardfuse.models import ModelShape
from shardfuse.planner.memory import (
    memory_terms,
    params_per_device,
    saved_elements_per_token,
)
from shardfuse.planner.options import MESH_AXES, Assumptions, Layout
from shardfuse.planner.terms import Term

# Elementwise traffic per token and layer, in h-sized tensors read or written (two
# norms: 2 x (h in, h out); two residual adds: 2 x (2h in, h out)), and per
# attention score without flash attention (QK^T out, softmax in/out, dropout mask,
# dropout out, AV in).
ELEMENTWISE_H_PASSES = 10
SOFTMAX_PASSES = 6
# Pipeline bubble relative to GPipe/1F1B's (P - 1) / m, per schedule.
_BUBBLE = {"gpipe": 1.0, "1f1b": 1.0, "zb-h1": 1.0 / 3.0}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The cost of one layout: FLOPs, time and memory terms, and their totals.

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


def axis_link(cluster: Cluster, layout: Layout, axis: str) -> tuple[float, float, str]:
    """`(bytes/s, latency s, link name)` of the ring over mesh axis `axis`.

    Devices are laid out in `MESH_AXES` order (innermost fastest); an axis whose
    group `stride * size` fits in one node uses the intra-node link, in both
    directions where that adds bandwidth (a torus: two links, capped by the
    chip's egress); any other the inter-node link.

    Example:
      >>> from shardfuse import hardware
      >>> from shardfuse.planner.cost import axis_link
      >>> from shardfuse.planner.options import Layout
      >>> c = hardware.cluster("h100", nodes=2)
      >>> layout = Layout(data=2, model=8)
      >>> axis_link(c, layout, "model")[2], axis_link(c, layout, "data")[2]
      ('NVLink 4', 'InfiniBand NDR')
    """
    sizes = layout.mesh_shape
    stride = 1
    for inner in reversed(MESH_AXES):
        if inner == axis:
            break
        stride *= sizes[inner]
    span = stride * sizes[axis]
    per_node = cluster.devices_per_node
    if span <= per_node and per_node % span == 0:
        link = cluster.intra_link
        return min(2 * link.gb_per_s, link.egress_gb_per_s) * 1e9, link.latency_us * 1e-6, link.name
    link = cluster.inter_link
    return link.gb_per_s * 1e9, link.latency_us * 1e-6, link.name


def _ring(n, full_bytes, bandwidth, latency, factor=1.0):
    """Ring all-gather / reduce-scatter of `full_bytes` over n devices (factor 2: all-reduce)."""
    if n <= 1:
        return 0.0
    return factor * ((n - 1) / n * full_bytes / bandwidth + (n - 1) * latency)


def estimate(
    model: ModelShape,
    cluster: Cluster,
    layout: Layout,
    *,
    global_batch: int,
    seq_len: int,
    assumptions: Assumptions | None = None,
) -> Estimate:
    """FLOPs, step time and memory of one training step of `model` under `layout`.

    Args:
      model: the transformer.
      cluster: the devices (their count must equal `layout.num_devices`).
      layout: the mesh sizes and options.
      global_batch: sequences per step (B).
      seq_len: tokens per sequence (s).
      assumptions: efficiency, precision and overlap (default `Assumptions()`).

    Returns:
      The `Estimate`, every term named.

    Raises:
      ValueError: the layout's device count differs from the cluster's.

    Example:
      >>> from shardfuse import hardware, models
      >>> from shardfuse.planner.cost import estimate
      >>> from shardfuse.planner.options import Layout
      >>> e = estimate(models.get("llama3-8b"), hardware.cluster("h100"), Layout(fsdp=8, zero=3,
      ...              remat="full", num_microbatches=2), global_batch=16, seq_len=4096)
      >>> 0 < e.mfu < 1, e.fits
      (True, True)
    """
    a = assumptions or Assumptions()
    if layout.num_devices != cluster.num_devices:
        raise ValueError(
            f"layout {layout.mesh_shape} has {layout.num_devices} devices, "
            f"the cluster {cluster.num_devices}"
        )
    n = cluster.num_devices
    P, D, F, C, T = (layout.pipeline, layout.data, layout.fsdp, layout.sequence, layout.model)
    v, mb, m = layout.virtual_stages, layout.microbatch_size, layout.num_microbatches
    h, L = model.hidden, model.num_layers
    B, s = global_batch, seq_len
    peak_flops = flops.peak_flops_per_s(cluster.device, a.compute_dtype)
    peak = peak_flops / 1e12
    rate = peak_flops * a.compute_efficiency

    # ---- FLOPs (shardfuse.flops) ----
    visible = mean_visible_keys(s, model.window, a.causal_skip)
    tokens = B * s
    model_flops = flops.model_flops(model, seq_len=s, batch=B)
    hardware_flops = flops.hardware_flops(
        model, seq_len=s, batch=B, remat=layout.remat, causal_skip=a.causal_skip
    )
    compute = hardware_flops / n / rate
    layers_dev = L / P
    training = flops.TRAINING_OVER_FORWARD
    # forward + backward matmuls and attention cores
    matmul_time = training * tokens * L * flops.layer_matmul_flops(model) / n / rate
    attention_hw = flops.layer_attention_flops(model, s, causal_skip=a.causal_skip)
    attention_time = training * tokens * L * attention_hw / n / rate

    # ---- communication ----
    act = a.activation_bytes
    mb_tokens = mb * s / C  # tokens of one microbatch on one device (before the model axis)
    time_terms = [
        Term(
            "compute",
            compute,
            f"{hardware_flops:.3e} hardware FLOPs / {n} devices / ({peak:g} TFLOP/s x "
            f"{a.compute_efficiency:g})",
        )
    ]
    if T > 1:
        bw, lat, name = axis_link(cluster, layout, "model")
        collectives = 8 + (4 if layout.remat == "full" else 0)
        per_layer = _ring(T, mb_tokens * h * act, bw, lat) * collectives
        tp = m * layers_dev * per_layer
        hidden = (T - 1) / T * matmul_time if a.tp_overlap else 0.0
        time_terms.append(
            Term(
                "tensor_parallel",
                max(0.0, tp - hidden),
                f"{m * layers_dev:g} layer-microbatches x {collectives} all-gather/reduce-scatter "
                f"of [{mb}, {s // C}, {h}] over model={T} on {name} = {tp:.3g} s"
                + (f", minus {hidden:.3g} s hidden behind the matmul rings" if hidden else ""),
            )
        )
    if C > 1:
        bw, lat, name = axis_link(cluster, layout, "sequence")
        kv_heads = max(model.kv_heads / T, 1.0)
        kv_bytes = mb_tokens * kv_heads * model.head_dim * 2 * act
        strategy = layout.cp_strategy
        if strategy == "ulysses":
            q_bytes = mb_tokens * model.heads / T * model.head_dim * act
            local = 2 * q_bytes + kv_bytes  # q, out and k, v
            cp = m * layers_dev * 2 * _ring(C, local, bw, lat)
            hidden = 0.0
        else:  # ring, ulysses_ring (modelled as ring), all_gather
            hops = 3 + (1 if layout.remat == "full" else 0)
            cp = m * layers_dev * hops * (C - 1) * (kv_bytes / bw + lat)
            overlapped = a.cp_overlap and strategy != "all_gather"
            hidden = (C - 1) / C * attention_time if overlapped else 0.0
        time_terms.append(
            Term(
                "context_parallel",
                max(0.0, cp - hidden),
                f"{strategy} attention over sequence={C} on {name}: {cp:.3g} s of K/V traffic"
                + (f", minus {hidden:.3g} s hidden behind attention" if hidden else ""),
            )
        )
    if P > 1:
        bw, lat, name = axis_link(cluster, layout, "pipeline")
        send = mb_tokens * h * act / (T if a.sequence_parallel else 1)
        pp = 2 * v * m * (send / bw + lat)
        time_terms.append(
            Term(
                "pipeline_p2p",
                0.0 if a.pp_overlap else pp,
                f"2 x {v} chunks x {m} microbatches ppermute of {send / 1e6:.3g} MB on {name}",
            )
        )
    params_dev = params_per_device(model, layout, a)
    if D * F > 1:
        g = params_dev * a.grad_comm_bytes
        bw_d, lat_d, name_d = axis_link(cluster, layout, "data")
        bw_f, lat_f, name_f = axis_link(cluster, layout, "fsdp")
        if layout.zero <= 1:
            bw, lat = (
                (min(bw_d, bw_f), max(lat_d, lat_f))
                if F > 1 and D > 1
                else ((bw_f, lat_f) if F > 1 else (bw_d, lat_d))
            )
            dp = _ring(D * F, g, bw, lat, factor=2.0)
            what = f"all-reduce of {g / 1e9:.3g} GB gradients over data x fsdp={D * F}"
        elif layout.zero == 2:
            dp = 2 * _ring(F, g, bw_f, lat_f) + _ring(D, g / F, bw_d, lat_d, factor=2.0)
            what = f"reduce-scatter + all-gather of {g / 1e9:.3g} GB over fsdp={F}"
        else:
            gathers = 2 + (1 if layout.remat == "full" else 0)
            dp = m * (gathers + 1) * _ring(F, g, bw_f, lat_f)
            dp += _ring(D, g / F, bw_d, lat_d, factor=2.0)
            what = f"{m} microbatches x ({gathers} parameter all-gathers + 1 reduce-scatter) "
            what += f"of {g / 1e9:.3g} GB over fsdp={F}"
        if D > 1 and layout.zero >= 2:
            what += f", all-reduce of the shards over data={D}"
        window = compute * (1.0 if layout.zero == 3 else 2.0 / 3.0) * a.dp_overlap
        time_terms.append(
            Term(
                "data_parallel",
                max(0.0, dp - window),
                f"{what}: {dp:.3g} s" + (f", minus {window:.3g} s overlapped" if window else ""),
            )
        )
    per_token = saved_elements_per_token(model, layout, a)
    # Memory-bound elementwise work (norms, residual adds, activation, and the
    # softmax over materialised scores without flash attention): each op reads
    # and writes its tensors once per pass; backward ~2 passes, recompute 1 more.
    token_split = T if a.sequence_parallel else 1
    mlp_io = (3 if model.activation == "swiglu" else 2) * model.ffn_hidden / T
    traffic = (ELEMENTWISE_H_PASSES * h / token_split + mlp_io) * act
    if not a.flash_attention:
        traffic += model.heads / T * visible * SOFTMAX_PASSES * act
    passes = 3 + (1 if layout.remat == "full" else 0)
    hbm = cluster.device.hbm_gb_per_s * 1e9
    elementwise = tokens / (D * F * C * P) * L * traffic * passes / hbm
    time_terms.append(
        Term(
            "elementwise",
            elementwise,
            f"{traffic / 1e3:.4g} kB per token and layer x {passes} passes x "
            f"{tokens / (D * F * C * P) * L:.4g} token-layers / {hbm / 1e9:g} GB/s HBM",
        )
    )
    if layout.remat == "offload":
        moved = 2 * tokens / n * L * (per_token["full_layer"] - per_token["saved"]) * act
        t_host = moved / (a.offload_gb_per_s * 1e9)
        time_terms.append(
            Term(
                "offload",
                max(0.0, t_host - compute),
                f"{moved / 1e9:.3g} GB to the host and back at {a.offload_gb_per_s:g} GB/s, "
                "hidden behind compute",
            )
        )
    if P > 1:
        pipelined = sum(t.value for t in time_terms if t.name != "pipeline_p2p")
        factor = 1.0 / v if layout.schedule == "interleaved" else _BUBBLE[layout.schedule]
        bubble = (P - 1) / m * factor * pipelined
        time_terms.append(
            Term(
                "pipeline_bubble",
                bubble,
                f"({P} - 1) / {m} microbatches x {factor:.3g} ({layout.schedule}) "
                f"x {pipelined:.3g} s",
            )
        )
    step_time = sum(t.value for t in time_terms)

    # ---- memory ----
    memory = memory_terms(model, layout, a, params_dev, per_token, mb_tokens, layers_dev, s)
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
