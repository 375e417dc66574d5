"""`Step`: what every term of the cost model reads, derived once from a step's inputs.

The inputs of one estimate (the model, the cluster, the `Parallelism`, the
`Assumptions`, the global batch and the sequence length) and the sizes and
rates every term of `cost.estimate` needs: the mesh sizes, the FLOP rates
(matmul and attention), the hardware FLOPs of the step and the share of them
that is attention, the tokens of a microbatch on a device, the layers of the
fullest pipeline stage. Notation: `cost`'s module docstring.
"""

import dataclasses
import functools

from shardfuse import flops
from shardfuse.hardware import Cluster
from shardfuse.model_spec import ModelSpec
from shardfuse.planner.efficiency import attention_efficiency
from shardfuse.planner.memory import slowest_stage_layers
from shardfuse.planner.options import Assumptions, Parallelism

# Einsums of the backward of a capacity-padded dense dispatch and combine (module
# `Step` docstring): the tokens' cotangent through the dispatch; the expert outputs' and
# the combine weights' through the combine (the boolean dispatch mask takes none).
DENSE_DISPATCH_BACKWARD_EINSUMS = 3


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step as the cost model sees it (`Step.of` derives the fields).

    Attributes:
      model, cluster, parallelism, a: the inputs (`a`: the `Assumptions`).
      B, s: sequences per step and tokens per sequence.
      n: devices; P, D, F, C, T: the mesh sizes; E: the expert axis; mb, m: sequences
        per microbatch and microbatches per replica (of `D x F x E`).
      peak_flops: the device's dense peak FLOP/s for the compute dtype.
      efficiency, overlap: the matmul efficiency and the overlap fraction assumed.
      rate, attention_rate: FLOP/s reached by the matmuls and by attention.
      tokens: tokens per step; mb_tokens: tokens of one microbatch on one device
        (before the model axis); layers_dev: layers of the fullest stage.
      visible: keys a query attends to, on average.
      hardware_flops: FLOPs the devices execute in the step (all devices).
      attention_flops: the attention cores' share of them.
      expert_flops: the routed experts' share of them (grouped matmuls; 0 when dense):
        `flops.expert_matmul_flops` per token and block, forward, backward and the
        recomputed forward under remat "full" (or the prefetch's rerun).
      reruns_forward: the backward reruns each layer's whole forward (remat "full",
        or the ZeRO-3 prefetch's recomputation).

    With `Assumptions.recompute_moe` (and no whole-forward rerun) `hardware_flops` and
    `expert_flops` hold one more forward of the routed experts; `reruns_moe` says so.
    With `Assumptions.expert_capacity_padded` and a capacity factor `c`, `hardware_flops`
    holds the dense dispatch and combine einsums (`[s, h]` of a sequence into `experts x
    s k c / experts` one-hot slots and back: `2 s k c h` per token, MoE block and einsum;
    two einsums a forward, three in the backward, where the boolean dispatch mask takes no
    cotangent), priced as matmuls.
    """

    model: ModelSpec
    cluster: Cluster
    parallelism: Parallelism
    a: Assumptions
    B: int
    s: int
    n: int
    P: int
    D: int
    F: int
    E: int
    C: int
    T: int
    mb: int
    m: int
    peak_flops: float
    efficiency: float
    overlap: float
    rate: float
    attention_rate: float
    tokens: int
    mb_tokens: float
    layers_dev: float
    visible: float
    hardware_flops: float
    attention_flops: float
    reruns_forward: bool
    expert_flops: float = 0.0

    @classmethod
    def of(cls, model, cluster, parallelism, *, global_batch, seq_len, assumptions=None):
        """The `Step` of these inputs.

        Raises:
          ValueError: the parallelism's device count differs from the cluster's.
        """
        a = assumptions or Assumptions()
        if parallelism.num_devices != cluster.num_devices:
            raise ValueError(
                f"parallelism {parallelism.mesh_shape} has {parallelism.num_devices} devices, "
                f"the cluster {cluster.num_devices}"
            )
        options = parallelism.options
        B, s = global_batch, seq_len
        peak_flops = flops.peak_flops_per_s(cluster.device, a.compute_dtype)
        efficiency = a.efficiency_for(cluster.device)
        rate = peak_flops * efficiency
        attention_rate = rate
        if a.flash_attention and a.compute_efficiency is None:
            attention_rate = peak_flops * (
                a.attention_efficiency or attention_efficiency(cluster.device)
            )
        tokens = B * s
        hardware_flops, attention_flops, expert_flops = _step_flops_once(
            model, B, s, options.remat, options.prefetch, options.capacity_factor,
            a.causal_skip, a.recompute_moe, a.expert_capacity_padded,
        )  # fmt: skip
        return cls(
            model=model,
            cluster=cluster,
            parallelism=parallelism,
            a=a,
            B=B,
            s=s,
            n=cluster.num_devices,
            P=parallelism.pipeline,
            D=parallelism.data,
            F=parallelism.fsdp,
            E=parallelism.expert,
            C=parallelism.sequence,
            T=parallelism.model,
            mb=parallelism.microbatch_size,
            m=options.num_microbatches,
            peak_flops=peak_flops,
            efficiency=efficiency,
            overlap=a.overlap_for(cluster.device),
            rate=rate,
            attention_rate=attention_rate,
            tokens=tokens,
            mb_tokens=parallelism.microbatch_size * s / parallelism.sequence,
            layers_dev=slowest_stage_layers(model, parallelism),
            visible=flops.mean_visible_keys(s, model.window, a.causal_skip),
            hardware_flops=hardware_flops,
            attention_flops=attention_flops,
            reruns_forward=options.remat == "full" or options.prefetch,
            expert_flops=expert_flops,
        )

    @property
    def reruns_moe(self) -> bool:
        """The backward reruns the MoE blocks' forward: the whole forward (`reruns_forward`)
        or the MoE blocks alone (`Assumptions.recompute_moe`)."""
        return self.reruns_forward or (self.a.recompute_moe and bool(self.model.moe_layers))

    @property
    def matmul_s(self) -> float:
        """Seconds of the forward and backward matmuls of the step, per device."""
        model = self.model
        return (
            flops.TRAINING_OVER_FORWARD * self.tokens * model.num_layers
            * flops.layer_matmul_flops(model) / self.n / self.rate
        )  # fmt: skip

    @property
    def expert_roofline(self) -> float:
        """The routed experts' matmuls' roofline: `min(1, intensity / ridge)`.

        One expert's matmuls on one device are `[M, K] @ [K, N]` with `{K, N} = {h,
        expert_hidden / T}` (expert tensor parallelism splits the expert) and M its
        tokens per microbatch: `mb_tokens x top_k x E / experts` (balanced routing over
        the expert group's tokens). Their arithmetic intensity, `2 M N K / (bytes x (M K
        + K N + M N))` FLOP per byte, against the device's ridge point (peak FLOP/s over
        HBM bytes/s): below it the matmul is memory-bound. Small experts split over T,
        or many experts with few tokens each, fall below it (maxtext#1256's MFU drop
        with many small experts). 1 for a dense model.

        Example:
          >>> from shardfuse import hardware, models
          >>> from shardfuse.planner.options import Parallelism
          >>> from shardfuse.planner.step import Step
          >>> qwen = models.get("qwen3-30b-a3b")  # experts of 768; 96 wide over model=8
          >>> step = Step.of(qwen, hardware.cluster("h100"), Parallelism(model=8),
          ...                global_batch=8, seq_len=4096)
          >>> round(step.expert_roofline, 2)
          0.23
        """
        model = self.model
        if not model.moe_layers:
            return 1.0
        M = self.expert_rows
        K, N = model.hidden, model.expert_ffn_hidden / self.T
        nbytes = self.a.activation_bytes
        intensity = 2 * M * N * K / (nbytes * (M * K + K * N + M * N))
        ridge = self.peak_flops / (self.cluster.device.hbm_gb_per_s * 1e9)
        return min(1.0, intensity / ridge)

    @property
    def expert_rate(self) -> float:
        """FLOP/s of the routed experts' grouped matmuls: the matmul rate x
        `grouped_matmul_efficiency` x `expert_roofline`."""
        return self.rate * self.grouped_matmul_efficiency * self.expert_roofline

    @property
    def expert_rows(self) -> float:
        """Rows of one routed expert's matmuls on a device per microbatch (balanced routing
        over the expert group's tokens): `mb_tokens x top_k x E / experts`."""
        model = self.model
        return self.mb_tokens * model.top_k * self.E / model.experts

    @property
    def grouped_matmul_efficiency(self) -> float:
        """The routed experts' grouped matmuls' fraction of the matmul rate: the stated
        `Assumptions.grouped_matmul_efficiency`, or, with `Assumptions.grouped_matmul_row_tile`,
        the tile visits of a kernel that visits a row tile once per group in it: `G` local
        experts (`experts / E`) of `expert_rows` rows each, `(G M / tile) / (G M / tile + G -
        1)`.

        1 where every expert is padded to its capacity (`Assumptions.expert_capacity_padded`
        with a `capacity_factor`): the experts are then plain batched einsums over static
        `[experts, batch, capacity, hidden]` buffers (MaxText's `dense_matmul`, layers/
        linears.py: "EBCM,EMH -> EBCH" up, "EBCH,EHM -> EBCM" down), every group the same
        size, no ragged group boundary or partial tile for the stated figure to stand for;
        the padding itself is priced by `cost.expert_imbalance` and small matmuls by
        `expert_roofline`.

        Example:
          >>> from shardfuse import hardware
          >>> from shardfuse.model_spec import ModelSpec
          >>> from shardfuse.planner.options import Assumptions, Parallelism
          >>> from shardfuse.planner.step import Step
          >>> moe = ModelSpec("moe", 1024, 8, 8, 128, 2048, num_layers=2, vocab_size=1000,
          ...                 experts=128, top_k=1)
          >>> step = Step.of(moe, hardware.cluster("v5p", devices_per_node=4),
          ...                Parallelism.of(fsdp=4, microbatch_size=4), global_batch=16,
          ...                seq_len=8192, assumptions=Assumptions(grouped_matmul_row_tile=512))
          >>> step.expert_rows, round(step.grouped_matmul_efficiency, 3)  # 64 tiles, 191 visits
          (256.0, 0.335)
        """
        if (self.a.expert_capacity_padded and self.model.moe_layers
                and self.parallelism.options.capacity_factor is not None):  # fmt: skip
            return 1.0
        tile = self.a.grouped_matmul_row_tile
        if not tile or not self.model.moe_layers:
            return self.a.grouped_matmul_efficiency
        groups = self.model.experts / self.E
        tiles = groups * self.expert_rows / tile
        return tiles / (tiles + groups - 1)

    @property
    def expert_s(self) -> float:
        """Seconds of the routed experts' grouped matmuls of the step, per device (balanced)."""
        return self.expert_flops / self.n / self.expert_rate

    @property
    def attention_s(self) -> float:
        """Seconds of the forward and backward attention cores of the step, per device."""
        model, a = self.model, self.a
        attention_hw = flops.layer_attention_flops(model, self.s, causal_skip=a.causal_skip)
        return (
            flops.TRAINING_OVER_FORWARD * self.tokens * model.num_layers * attention_hw
            / self.n / self.attention_rate
        )  # fmt: skip


def _step_flops(model, B, s, remat, prefetch, capacity, causal_skip, recompute_moe,
                expert_capacity_padded) -> tuple[float, float, float]:  # fmt: skip
    """`(hardware_flops, attention_flops, expert_flops)` of `Step.of` (its attributes):
    the same for every mesh of a search, computed once per remat policy and prefetch
    (`_step_flops_once`)."""
    L, tokens = model.num_layers, B * s
    hardware_flops = flops.hardware_flops(
        model, seq_len=s, batch=B, remat=remat, causal_skip=causal_skip, prefetch=prefetch
    )
    # Attention cores run as flash-attention kernels (their own efficiency) or, without
    # flash attention, as batched matmuls; recomputed once more under "full",
    # "selective" and "offload" remat (with the prefetch: in the rerun forward of
    # every layer but the last, and in every layer for the policy inside it).
    reruns = 1 if remat in ("full", "selective", "offload") else 0
    attention_hw = flops.layer_attention_flops(model, s, causal_skip=causal_skip)
    attention_flops = (flops.TRAINING_OVER_FORWARD + reruns) * tokens * L * attention_hw
    if prefetch:
        inside = L if remat in ("selective", "offload") else 0
        rerun_layers = L - 1 + inside
        attention_flops = (flops.TRAINING_OVER_FORWARD * L + rerun_layers) * tokens * (attention_hw)
    # The routed experts' grouped matmuls: forward, backward (2 x), and the forward once
    # more where the backward reruns it ("full"; the prefetch: every layer but the last).
    # `Assumptions.recompute_moe` reruns the MoE blocks' forward under any other policy.
    expert_passes = flops.TRAINING_OVER_FORWARD * L
    if prefetch:
        expert_passes += L - 1
    elif remat == "full":
        expert_passes += L
    elif recompute_moe and model.moe_layers:
        expert_passes += L
        hardware_flops += L * tokens * flops.expert_matmul_flops(model)
    expert_flops = expert_passes * tokens * flops.expert_matmul_flops(model)
    if expert_capacity_padded and capacity is not None and model.moe_layers:
        # The dense dispatch and combine: one-hot einsums of each sequence's `s` tokens
        # into (and out of) `experts x capacity` slots, `capacity = s k c / experts`:
        # `2 s k c h` FLOPs per token, MoE block and einsum, as matmuls. The forward
        # runs both (and again where the backward reruns it); the backward three, not
        # four: the dispatch mask is boolean (MaxText's `dense_matmul`: `dispatch_mask =
        # combine_mask.astype(bool)`), so only the tokens' cotangent goes back through
        # the dispatch, while the combine's float mask (the router's weights) takes
        # one besides the expert outputs'.
        moe_blocks = len(model.moe_layers) / L
        einsum = 2 * s * model.top_k * capacity * model.hidden
        dispatch_passes = expert_passes - (flops.TRAINING_OVER_FORWARD - 1) * L
        einsums = 2 * dispatch_passes + DENSE_DISPATCH_BACKWARD_EINSUMS * L
        hardware_flops += einsums * moe_blocks * tokens * einsum
    return hardware_flops, attention_flops, expert_flops


# A pure function of hashable values (a frozen `ModelSpec` and scalars; `typed`: True is not
# 1), asked for by every candidate of a search with the same few arguments.
_cached_step_flops = functools.lru_cache(maxsize=1024, typed=True)(_step_flops)


def _step_flops_once(*args) -> tuple[float, float, float]:
    """`_step_flops(*args)`, computed once per distinct `args` (a spec holding an unhashable
    value: every time)."""
    try:
        hash(args)
    except TypeError:
        return _step_flops(*args)
    return _cached_step_flops(*args)
