"""The knobs a plan sets (`Parallelism`) and the assumptions the cost model makes (`Assumptions`).

A `Parallelism` is one point of the search space: the mesh sizes over the axes
`pipeline, data, fsdp, expert, sequence, model` (outermost to innermost), the run's
options (`sf.parallel.RunOptions`: ZeRO, remat, prefetch, microbatches, the
pipeline schedule) and the planner's own choices (microbatch size,
context-parallel strategy). `Assumptions` are the numbers
the cost model cannot know from the model and the hardware tables: the
fraction of peak FLOP/s a matmul reaches (default: per hardware generation,
`planner.efficiency`), the precision, which collectives overlap with compute
and how much of them hides (default: per hardware), and how the pipeline
executor runs. Presets (`Assumptions.preset(name)`, `PRESETS`): "shardfuse"
(the default: shardfuse's layers and pipeline executor as they run today),
"megatron-2021", "megatron-2022", "megascale", "megatron-moe", "llama3",
"automodel", "maxtext", "palm" (the systems of the published runs in
tests/planner/test_validation.py).
"""

import dataclasses
import functools
import warnings

from shardfuse import axes
from shardfuse.flops import REMAT_POLICIES as REMAT_POLICIES  # remat changes the FLOPs
from shardfuse.layers.fsdp import ZERO_STAGES as ZERO_STAGES  # their one home
from shardfuse.parallel.options import RunOptions
from shardfuse.parallel.pipeline.schedule import SCHEDULES as SCHEDULES  # their one home
from shardfuse.planner.efficiency import EXPERT_IMBALANCE

# The expert axis (issue 44): `axes.EXPERT` where the axes module declares it; until then
# the planner places it where the issue does, between fsdp and sequence. Merge note: with
# `axes.EXPERT` in `axes.MESH_AXES` this is `axes.MESH_AXES` itself.
EXPERT = getattr(axes, "EXPERT", "expert")
if EXPERT in axes.MESH_AXES:
    MESH_AXES = axes.MESH_AXES  # outermost -> innermost
else:
    MESH_AXES = (axes.PIPELINE, axes.DATA, axes.FSDP, EXPERT, axes.SEQUENCE, axes.MODEL)

PIPELINE_EXECUTORS = ("lockstep", "async")
ZERO2_SCATTER = ("microbatch", "step")
SAVED_ACTIVATIONS = ("shardfuse", "korthikanti")
CP_STRATEGIES = ("ring", "all_gather", "ulysses", "ulysses_ring")


def check_positive_int(name, value):
    """ValueError naming `name` unless `value` is an int >= 1 (a size, a batch, a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def _choice(name, value, valid):
    if value not in valid:
        raise ValueError(f"{name}={value!r} must be one of {valid}")


# The fields of `RunOptions` a search point sets (the rest keep their defaults or follow
# the assumptions: `sequence_parallel`), by the keyword `Parallelism.of` routes to them.
RUN_CHOICES = ("zero", "remat", "prefetch", "num_microbatches", "schedule", "virtual_stages")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """One point of the search space: the mesh sizes, the run's options, and the planner's own.

    The run's choices are one `sf.parallel.RunOptions` (`options`: ZeRO stage,
    remat, prefetch, microbatches, pipeline schedule, virtual stages), checked
    there, not copied here; `Parallelism.of(...)` takes them as keywords, and
    `replace` changes them like the other fields.

    Attributes:
      pipeline, data, fsdp, sequence, model: mesh axis sizes.
      expert: the expert axis size (keyword only, default 1): a mixture of
        experts' routed experts are sharded over it and tokens dispatched to them
        by all-to-all; outside the MoE blocks it splits the batch like `data`.
      options: the run's `sf.parallel.RunOptions` (its `zero` over the `fsdp`
        axis: 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters
        sharded; `remat` of each block; `prefetch` of the ZeRO-3 layers;
        `num_microbatches` per step per replica, pipeline microbatches or
        gradient accumulation steps; ...). Its `sequence_parallel` is not
        read: the cost model follows `Assumptions.sequence_parallel`, which
        `Plan.run_options()` hands on.
      microbatch_size: sequences per microbatch per data replica.
      cp_strategy: context-parallel attention over `sequence` ("ring",
        "all_gather", "ulysses", "ulysses_ring").

    Example:
      >>> from shardfuse.planner.options import Parallelism
      >>> Parallelism.of(data=2, model=4).num_devices
      8
      >>> Parallelism.of(fsdp=8, zero=3, num_microbatches=2).options.zero
      3
    """

    pipeline: int = 1
    data: int = 1
    fsdp: int = 1
    sequence: int = 1
    model: int = 1
    options: RunOptions = RunOptions()
    microbatch_size: int = 1
    cp_strategy: str = "ring"
    expert: int = dataclasses.field(default=1, kw_only=True)  # keyword: positions unchanged

    def __post_init__(self):
        for name in (*MESH_AXES, "microbatch_size"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.options, RunOptions):
            raise TypeError(f"options={self.options!r} must be an sf.parallel.RunOptions")
        _choice("cp_strategy", self.cp_strategy, CP_STRATEGIES)

    @classmethod
    def of(cls, **fields) -> "Parallelism":
        """A `Parallelism` from flat keywords: mesh sizes, `microbatch_size`, `cp_strategy`,
        and the `RunOptions` fields (`zero=`, `remat=`, ...) for its `options`."""
        return cls().replace(**fields)

    def replace(self, **changes) -> "Parallelism":
        """A copy with `changes`, the `RunOptions` fields among them set on `options`."""
        run = {name: changes.pop(name) for name in RUN_CHOICES if name in changes}
        if run:
            changes["options"] = changes.get("options", self.options).replace(**run)
        return dataclasses.replace(self, **changes)

    @functools.cached_property
    def mesh_shape(self) -> dict[str, int]:
        """Axis name -> size, outermost first (`MESH_AXES` order)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @functools.cached_property
    def num_devices(self) -> int:
        """The product of the mesh sizes."""
        n = 1
        for size in self.mesh_shape.values():
            n *= size
        return n

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: `data * fsdp * expert` (each sees `global_batch / replicas`
        sequences; the expert axis splits the batch outside the MoE blocks)."""
        return self.data * self.fsdp * self.expert

    def choices(self) -> dict:
        """The choices a plan makes beyond the mesh, flat: the run's options it sets,
        `microbatch_size` and `cp_strategy` (a plan's JSON "options")."""
        run = {name: getattr(self.options, name) for name in RUN_CHOICES}
        return dict(run, microbatch_size=self.microbatch_size, cp_strategy=self.cp_strategy)


def Layout(**fields) -> Parallelism:  # noqa: N802 (the class it was)
    """Deprecated: `Parallelism.of(**fields)` (the planner's layout is now `Parallelism`:
    "layout" is the ring's token order)."""
    warnings.warn(
        "sf.planner.Layout is deprecated and will be removed in the next release: use "
        "sf.planner.Parallelism (Parallelism.of(**fields) takes the same keywords)",
        DeprecationWarning,
        stacklevel=2,
    )
    return Parallelism.of(**fields)


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What the cost model assumes beyond the model and hardware tables.

    Attributes:
      name: the preset these assumptions come from ("shardfuse", "megatron-2021", ...;
        "custom" when a field was changed by hand), recorded in every plan's JSON.
      compute_efficiency: fraction of the dense peak FLOP/s that the matmuls and
        attention reach; None (default): the device's, `efficiency.matmul_efficiency`
        (measured MAMF per generation x one layer-shape factor; sources there).
      overlap: fraction of an overlappable collective's time that hides behind the
        compute running beside it; None (default): the device's,
        `efficiency.overlap_fraction` (GPUs 0.85, TPUs 0.95, CPUs 0: stated).
      pipeline_executor: "lockstep" (shardfuse's executor: scans over the
        schedule's `LockstepTable`, a `ppermute` every tick, every stage one F and
        one B per tick: `lockstep.lockstep_work`) or "async" (Megatron-style: stages run their
        own order, the bubble is the schedule's closed form).
      pipeline_recompute: a backward tick reruns the stage forward from the kept
        stage input (`Pipeline(residuals="recompute")`, the default); False:
        residuals kept (`residuals="stored"`, Megatron).
      compute_dtype: the dtype whose peak is used ("bfloat16", "float16", "float32").
      activation_bytes: bytes per activation element saved for the backward pass.
      param_bytes, grad_bytes, optimizer_bytes: bytes per parameter of the
        weights the step reads, of the gradients, and of the optimizer state
        (Adam: two moments, plus an fp32 master copy in mixed precision).
      grad_comm_bytes: bytes per element of gradient/parameter collectives.
      causal_skip: the attention kernels skip fully masked blocks (flash
        attention): causal attention costs about half.
      tp_overlap: tensor-parallel all-gathers/reduce-scatters run as
        collective matmul rings (hidden behind the matmuls as far as the ring
        allows); False: exposed, as Megatron-LM 2021.
      cp_overlap: ring attention hides its K/V transfers behind the blocks.
      dp_overlap: fraction of the backward compute behind which the data/fsdp
        gradient reductions and ZeRO-3 gathers can hide (0: none, 1: all).
      pp_overlap: pipeline sends overlap the next microbatch's compute.
      zero2_scatter: when ZeRO-2 reduce-scatters the gradients of an accumulated
        step: "microbatch" (shardfuse's `accumulate(zero=2)` default: every
        microbatch's backward reduce-scatters its gradients, m reduce-scatters a
        step, each behind its own backward) or "step" (Megatron's distributed
        optimizer: gradients accumulated locally, one reduce-scatter a step).
      sequence_parallel: Megatron sequence parallelism (norms and residuals
        sharded over `model` too); False: they are replicated over `model`.
      residual_sharded: the layer inputs saved for the backward pass are sharded over
        `model` even without sequence parallelism (GSPMD's 2D sharding of PaLM splits
        them along the hidden dimension); the sequence length need not divide by it.
      flash_attention: attention keeps no `[s, s]` scores; False keeps
        `attention_scores_bytes_per_key` bytes per head and key (Korthikanti et al.'s
        5: fp16 softmax output, its dropout mask and dropout output).
      attention_scores_bytes_per_key: see `flash_attention`.
      saved_activations: which tensors a layer keeps for its backward pass
        (`memory.saved_elements_per_token`): "shardfuse" (its layers', counted with
        `jax.ad_checkpoint.print_saved_residuals`; "selective" keeps the projections'
        outputs and recomputes the norms and the MLP activation too) or "korthikanti"
        (Megatron-LM's, Korthikanti et al. 2022 sec. 4.1: `sbh (34 + 5 a s / h)` bytes a
        GPT layer, the norms' inputs and outputs, the dropout masks and the MLP
        activation's input and output included; "selective" recomputes the attention
        core only).
      embedding_sharded: embedding and output tables are split over `model`
        (vocabulary-parallel); False: the input table is replicated.
      logits_bytes: bytes per logit kept for the loss (float32 cross-entropy).
      logits_copies: logit-sized buffers alive at once (logits, softmax, gradient).
      donate: the step donates its parameters and optimizer state (outputs
        reuse the input buffers); False adds a second copy of them (outputs).
      offload_gb_per_s: host link bandwidth for remat="offload" (PCIe 5: 50 GB/s).
      expert_imbalance: mixture of experts over an expert axis > 1: the most loaded
        device's routed tokens over the mean, which every device waits for (the
        routed experts' compute is charged this factor; a `capacity_factor` caps
        it). Measured: `efficiency.EXPERT_IMBALANCE` (1.229) by default, a trained
        router's per-micro-batch load over EP 8 (FEPLB, arXiv:2604.19654: GLM-5, 128
        experts, H100s; its sources there); an untrained one may be worse.
      grouped_matmul_efficiency: the routed experts' grouped matmuls reach this
        fraction of the dense matmul efficiency (ragged groups, partial tiles at
        group boundaries, smaller matmuls per expert). STATED: 0.85 by default
        (MaxText reports MFU falling with many small experts, maxtext#1256; no
        per-kernel figure is published to fit).
      attention_efficiency: fraction of the dense peak the fused attention kernels reach,
        forward and backward; None (default): the device's FlashAttention-2 figure
        (`efficiency.attention_efficiency`). Systems on Transformer Engine run cuDNN's
        fused attention on Hopper (`efficiency.CUDNN_ATTENTION`: presets "megatron-moe",
        "automodel").
      grouped_matmul_row_tile: the grouped matmul's row tile where its kernel visits a tile
        once for every expert group the tile holds rows of (MaxText's megablox `gmm`, its
        `tile_batch_seq` 512): a device's `G` local experts of `M` rows each take
        `G M / tile + G - 1` tile visits for `G M / tile` tiles of work, efficiency `(G M /
        tile) / (G M / tile + G - 1)`, in place of the stated `grouped_matmul_efficiency`
        (partial tiles at group boundaries are what that stands for). None (default): the
        stated figure.
      expert_capacity_padded: under a `capacity_factor` the routed experts compute
        capacity-sized buffers (GShard-style dense dispatch and einsums: MaxText with
        `sparse_matmul=False`): every device's expert matmuls cost `capacity_factor x`
        the balanced routed FLOPs whatever the routing (no wait for a most loaded
        device: all are padded alike). False (default, shardfuse's sort-based ragged
        dispatch): a capacity only drops slots, it pads nothing.
      recompute_moe: the backward pass reruns each mixture-of-experts block's forward
        (Megatron's `--recompute-modules moe`): one more pass of the routed experts'
        grouped matmuls, of the dispatch and combine all-to-alls and of the
        permutation, beside the run's remat policy (no effect where that reruns the
        whole forward already: "full", the ZeRO-3 prefetch). False (default).
      loss_slot: the pipeline split gives the head (logits and loss) one layer slot of the
        last stage, which then holds one layer fewer than the planned `num_layers / P`
        (Megatron's `--account-for-loss-in-pipeline-split`; Llama 3's last stage one layer
        short): an async pipeline's last stage runs the head in place of that layer
        (`cost.pipeline_head`). False (default): the head runs beside the stage's layers.
      moe_host_s: seconds the GPU waits on the host per mixture-of-experts block and
        microbatch, forward and backward together: a system whose MoE layer launches its
        many small kernels one by one from Python, after a device-to-host copy of the
        token counts that drains the GPU's queue (Megatron-Core without CUDA graphs over
        the layer), leaves the GPU idle while the host catches up, whatever the tokens
        (`cost.moe_host`). 0 (default): no such wait (shardfuse's jitted step; XLA).
        Preset "megatron-moe": `efficiency.MEGATRON_MOE_HOST_S` (its sources there).
      ep_overlap: the dispatch and combine all-to-alls hide behind the expert
        compute (chunked, as the collective matmuls hide theirs); False
        (default): exposed.
      ep_node_dedup: an expert group spanning nodes sends each token once to each
        remote node that holds one of its experts, which forwards it over the node's
        own links (DeepSeek-V3's dispatch, DeepEP); False (default, shardfuse's
        all-to-all): every routed copy crosses the network.
      moe_sequence_sharded: with sequence parallelism each `model` rank routes,
        dispatches and keeps only its own `1 / model` of the tokens in a mixture-of-experts
        block (Megatron-Core at expert tensor parallelism 1: its dispatcher starts from the
        sequence-parallel shards). False (default, shardfuse's `ParallelMoE`): the block
        first gathers the sequence over `model` (which splits each expert's hidden
        dimension), so every model rank routes, dispatches and keeps all of its data
        shard's tokens (`moe_token_split`).
      ep_static_receive: the expert-parallel receive buffers are sized for the worst
        case, `expert x` the routed rows a device sends (any device may receive every
        routed row of its group, dropless: shardfuse's `ParallelMoE`, whose shapes are
        static), and the backward keeps them (`memory.receive_factor`). False: sized by
        the routing (PyTorch's dynamic shapes: Megatron-Core, AutoModel).
      reserved_fraction: HBM kept free for the runtime, fragmentation and
        workspace; a plan must fit in `(1 - reserved_fraction) * HBM`.

    Example:
      >>> from shardfuse.planner.options import Assumptions
      >>> Assumptions.megatron_2021().tp_overlap
      False
    """

    name: str = "shardfuse"
    compute_efficiency: float | None = None
    overlap: float | None = None
    pipeline_executor: str = "lockstep"
    pipeline_recompute: bool = True
    compute_dtype: str = "bfloat16"
    activation_bytes: int = 2
    param_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    grad_comm_bytes: int = 2
    causal_skip: bool = True
    tp_overlap: bool = True
    cp_overlap: bool = True
    dp_overlap: float = 1.0
    pp_overlap: bool = False
    zero2_scatter: str = "microbatch"
    sequence_parallel: bool = True
    residual_sharded: bool = False
    flash_attention: bool = True
    attention_scores_bytes_per_key: int = 5
    saved_activations: str = "shardfuse"
    embedding_sharded: bool = True
    logits_bytes: int = 4
    logits_copies: int = 2
    donate: bool = True
    offload_gb_per_s: float = 50.0
    reserved_fraction: float = 0.1
    expert_imbalance: float = EXPERT_IMBALANCE
    grouped_matmul_efficiency: float = 0.85
    ep_overlap: bool = False
    ep_node_dedup: bool = False
    moe_sequence_sharded: bool = False
    ep_static_receive: bool = True
    expert_capacity_padded: bool = False
    grouped_matmul_row_tile: int | None = None
    attention_efficiency: float | None = None
    recompute_moe: bool = False
    loss_slot: bool = False
    moe_host_s: float = 0.0

    def __post_init__(self):
        if self.compute_efficiency is not None and not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"compute_efficiency={self.compute_efficiency!r} must be in (0, 1]")
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap={self.overlap!r} must be in [0, 1]")
        _choice("pipeline_executor", self.pipeline_executor, PIPELINE_EXECUTORS)
        _choice("zero2_scatter", self.zero2_scatter, ZERO2_SCATTER)
        _choice("saved_activations", self.saved_activations, SAVED_ACTIVATIONS)
        if not 0 <= self.dp_overlap <= 1:
            raise ValueError(f"dp_overlap={self.dp_overlap!r} must be in [0, 1]")
        if not 0 <= self.reserved_fraction < 1:
            raise ValueError(f"reserved_fraction={self.reserved_fraction!r} must be in [0, 1)")
        if self.attention_efficiency is not None and not 0 < self.attention_efficiency <= 1:
            raise ValueError(
                f"attention_efficiency={self.attention_efficiency!r} must be in (0, 1]"
            )
        if not self.expert_imbalance >= 1:
            raise ValueError(f"expert_imbalance={self.expert_imbalance!r} must be >= 1")
        if not self.moe_host_s >= 0:
            raise ValueError(f"moe_host_s={self.moe_host_s!r} must be >= 0")
        if not 0 < self.grouped_matmul_efficiency <= 1:
            raise ValueError(
                f"grouped_matmul_efficiency={self.grouped_matmul_efficiency!r} must be in (0, 1]"
            )

    def efficiency_for(self, device) -> float:
        """`compute_efficiency`, or the device's (`efficiency.matmul_efficiency`) when None."""
        from shardfuse.planner.efficiency import matmul_efficiency

        if self.compute_efficiency is not None:
            return self.compute_efficiency
        return matmul_efficiency(device)

    def overlap_for(self, device) -> float:
        """`overlap`, or the device's (`efficiency.overlap_fraction`) when None."""
        from shardfuse.planner.efficiency import overlap_fraction

        return overlap_fraction(device) if self.overlap is None else self.overlap

    def moe_token_split(self, model: int) -> int:
        """What divides a device's tokens in its mixture-of-experts blocks (their routed
        copies, dispatch and saved rows) over a `model` axis of size `model`: `model` where
        the dispatch starts from the sequence-parallel shards (`sequence_parallel` and
        `moe_sequence_sharded`), else 1 (shardfuse: every model rank holds them all).

        Example:
          >>> from shardfuse.planner.options import Assumptions
          >>> megatron = Assumptions.preset("megatron-moe")
          >>> Assumptions().moe_token_split(4), megatron.moe_token_split(4)
          (1, 4)
        """
        return model if self.sequence_parallel and self.moe_sequence_sharded else 1

    def to_dict(self, device=None) -> dict:
        """Every field (JSON-ready); with `device`, the efficiency and overlap resolved for it."""
        out = dataclasses.asdict(self)
        if device is not None:
            out["compute_efficiency"] = self.efficiency_for(device)
            out["overlap"] = self.overlap_for(device)
        return out

    @classmethod
    def preset(cls, name: str, **overrides) -> "Assumptions":
        """The assumptions of a named system (`PRESETS`), with `overrides` applied.

        Raises:
          ValueError: an unknown name (the message lists `PRESETS`).

        Example:
          >>> from shardfuse.planner.options import Assumptions
          >>> Assumptions.preset("megatron-2022").sequence_parallel
          True
        """
        if name not in PRESETS:
            raise ValueError(f"assumptions preset {name!r} is not one of {tuple(PRESETS)}")
        a = PRESETS[name]()
        if overrides:
            a = dataclasses.replace(a, **overrides)
        return a

    @classmethod
    def megatron_2021(cls) -> "Assumptions":
        """The setting of Narayanan et al. 2021 (Megatron-LM on Selene A100s).

        fp16 mixed precision (fp16 weights, fp32 main gradients, fp32 master
        weights and Adam moments: 2 + 4 + 12 bytes per parameter), gradients
        all-reduced in fp16 after the backward pass (no overlap), tensor-parallel
        all-reduces exposed, point-to-point pipeline sends exposed, attention
        computed in full (no causal skipping), no flash attention; the distributed
        optimizer reduce-scatters the accumulated gradients once a step; the layers keep
        what Megatron's keep for the backward pass (`saved_activations="korthikanti"`).
        """
        return cls(
            name="megatron-2021",
            compute_dtype="float16",
            causal_skip=False,
            tp_overlap=False,
            cp_overlap=False,
            dp_overlap=0.0,
            sequence_parallel=False,
            flash_attention=False,
            pipeline_executor="async",
            pipeline_recompute=False,
            zero2_scatter="step",
            saved_activations="korthikanti",
        )

    @classmethod
    def megatron_2022(cls) -> "Assumptions":
        """Korthikanti et al. 2022 (Megatron-LM with sequence parallelism, selective recompute).

        As `megatron_2021` (A100s, no flash attention, no causal skipping), with bf16
        and Megatron sequence parallelism; its all-gathers and reduce-scatters are not
        overlapped with the matmuls.
        """
        return dataclasses.replace(
            cls.megatron_2021(), name="megatron-2022", compute_dtype="bfloat16",
            sequence_parallel=True,
        )  # fmt: skip

    @classmethod
    def megascale(cls) -> "Assumptions":
        """Jiang et al. 2024 (MegaScale, Megatron-based): TP and DP communication overlapped.

        Tensor-parallel all-gathers/reduce-scatters fused with the matmuls, the data-
        parallel reduce-scatter/all-gather overlapped with the first and last
        microbatches, FlashAttention-2, an async interleaved 1F1B pipeline.
        """
        return dataclasses.replace(
            cls.megatron_2022(), name="megascale", tp_overlap=True, dp_overlap=1.0,
            flash_attention=True,
        )  # fmt: skip

    @classmethod
    def llama3(cls) -> "Assumptions":
        """Dubey et al. 2024 (Llama 3, Meta's 4D parallelism on H100s).

        FSDP over the data axis overlapped with compute, tensor parallelism with
        sequence parallelism (not overlapped), flash attention, an async interleaved
        pipeline keeping its activations (no stage recompute).
        """
        return dataclasses.replace(
            cls.megatron_2022(), name="llama3", dp_overlap=1.0, flash_attention=True,
        )  # fmt: skip

    @classmethod
    def megatron_moe(cls) -> "Assumptions":
        """Megatron-Core MoE on H100s (2025; the Qwen3 runs of `published.RUNS`).

        As `megatron_2022` (bf16, sequence parallelism, tensor-parallel collectives not
        overlapped, an async interleaved pipeline keeping its activations), with
        Transformer Engine's flash attention (causal blocks skipped), the gradient
        reduction overlapped with the backward pass (`--overlap-grad-reduce`), DeepEP's
        dispatch (`ep_node_dedup`: a token crosses the network once per remote node) from
        the sequence-parallel shards (`moe_sequence_sharded`, expert tensor parallelism 1), and
        the expert all-to-alls exposed (`ep_overlap=False`; their "1F1B overlap" run,
        preset "megatron-moe-overlap", sets it). Its "A2A" dispatcher (Megatron's all-to-all,
        not DeepEP) is `ep_node_dedup=False` on the run. Attention: Transformer Engine's
        cuDNN fused attention (TE prefers it to FlashAttention on Hopper:
        `get_attention_backend`, "Disabling FlashAttention to give FusedAttention preference
        on Hopper+ for performance reasons"), at `efficiency.CUDNN_ATTENTION`. Its MoE layers
        run eager (the runs set no CUDA graphs): the host's launches and the token counts'
        device-to-host sync cost `efficiency.MEGATRON_MOE_HOST_S` per MoE layer and
        microbatch (`moe_host_s`), whatever the dispatcher.
        """
        from shardfuse.planner.efficiency import CUDNN_ATTENTION, MEGATRON_MOE_HOST_S

        return dataclasses.replace(
            cls.megatron_2022(), name="megatron-moe", flash_attention=True, causal_skip=True,
            dp_overlap=1.0, ep_node_dedup=True, attention_efficiency=CUDNN_ATTENTION,
            moe_host_s=MEGATRON_MOE_HOST_S, moe_sequence_sharded=True, ep_static_receive=False,
        )  # fmt: skip

    @classmethod
    def automodel(cls) -> "Assumptions":
        """NeMo AutoModel on H100s (PyTorch FSDP2, Transformer Engine, DeepEP; its Qwen3-30B
        run of `published.RUNS`): TE's flash attention (causal blocks skipped), the FSDP2
        collectives overlapped with compute, DeepEP's dispatch (`ep_node_dedup`), Megatron's
        count of saved activations (TE layers), TE's cuDNN attention as `megatron_moe`'s.
        """
        from shardfuse.planner.efficiency import CUDNN_ATTENTION

        return dataclasses.replace(
            cls(), name="automodel", ep_node_dedup=True, saved_activations="korthikanti",
            ep_static_receive=False,
            pipeline_executor="async", pipeline_recompute=False,
            attention_efficiency=CUDNN_ATTENTION,
        )  # fmt: skip

    @classmethod
    def maxtext(cls) -> "Assumptions":
        """MaxText on TPU (XLA: async collectives overlapped, flash attention, no pipeline).

        Its TPU flash attention is splash attention, whose causal mask skips the fully
        masked blocks (`causal_skip`; issue 45: False before, which charged the masked half
        of every causal attention).
        """
        return cls(name="maxtext", causal_skip=True, tp_overlap=True, dp_overlap=1.0,
                   pipeline_executor="async", pipeline_recompute=False)  # fmt: skip

    @classmethod
    def palm(cls) -> "Assumptions":
        """Chowdhery et al. 2022 (PaLM on TPU v4): as `maxtext`, no sequence parallelism.

        12-way model parallelism without Megatron's sequence parallelism (the sequence
        length need not divide by it; GSPMD shards the saved layer inputs along the
        hidden dimension instead), no flash attention (2022).
        """
        return dataclasses.replace(
            cls.maxtext(), name="palm", sequence_parallel=False, residual_sharded=True,
            flash_attention=False, causal_skip=False,
        )  # fmt: skip

    @classmethod
    def float32(cls, **overrides) -> "Assumptions":
        """Everything float32 with Adam (the 8-CPU-device tests): 4 + 4 + 8 bytes per parameter."""
        kwargs = dict(
            name="float32",
            compute_dtype="float32",
            activation_bytes=4,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=8,
            grad_comm_bytes=4,
        )
        kwargs.update(overrides)
        return cls(**kwargs)


PRESETS = {
    "shardfuse": Assumptions,
    "megatron-2021": Assumptions.megatron_2021,
    "megatron-2022": Assumptions.megatron_2022,
    "megascale": Assumptions.megascale,
    "megatron-moe": Assumptions.megatron_moe,
    "megatron-moe-overlap": lambda: dataclasses.replace(
        Assumptions.megatron_moe(), name="megatron-moe-overlap", ep_overlap=True
    ),
    "llama3": Assumptions.llama3,
    "automodel": Assumptions.automodel,
    "maxtext": Assumptions.maxtext,
    "palm": Assumptions.palm,
    "float32": Assumptions.float32,
}
