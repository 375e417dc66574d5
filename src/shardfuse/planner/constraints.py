"""The divisibility rules a `Parallelism` must keep: heads, MLP, sequence, layers, batch, ZeRO.

Each message names the rule it breaks and the values (`heads=32 % model=3 != 0`):
a pinned parallelism the planner cannot run is refused with these messages.
"""

from shardfuse.model_spec import ModelSpec
from shardfuse.planner.options import Assumptions, Parallelism


def mlp_widths(model: ModelSpec) -> dict[str, int]:
    """The MLP hidden sizes the model axis must divide, by field: `ffn_hidden` where a block
    is dense, `expert_hidden` (expert tensor parallelism) and `shared_expert_hidden` where
    one is a mixture of experts.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.constraints import mlp_widths
      >>> mlp_widths(models.get("qwen1.5-moe-a2.7b"))
      {'expert_hidden': 1408, 'shared_expert_hidden': 5632}
      >>> mlp_widths(models.get("llama3-8b"))
      {'ffn_hidden': 14336}
    """
    widths = {}
    if len(model.moe_layers) < model.num_layers:
        widths["ffn_hidden"] = model.ffn_hidden
    if model.moe_layers:
        widths["expert_hidden"] = model.expert_ffn_hidden
        if model.shared_experts:
            widths["shared_expert_hidden"] = model.shared_expert_ffn_hidden
    return widths


def sequence_shards(
    parallelism: Parallelism, assumptions: Assumptions | None = None
) -> tuple[int, int]:
    """`(ring chunks, model)`: how many pieces the sequence is cut into by what shards it.

    The sequence axis cuts it into `C` pieces (`2 C` for a zigzag ring); the model
    axis cuts it again only with Megatron sequence parallelism
    (`Assumptions.sequence_parallel`): without it the activations are replicated
    over `model`, and the sequence length need not divide by it (PaLM's 12-way
    model parallelism at s = 2048).
    """
    a = assumptions or Assumptions()
    C = parallelism.sequence
    ring = 2 * C if C > 1 and parallelism.cp_strategy != "ulysses" else C
    return ring, parallelism.model if a.sequence_parallel else 1


def parallelism_constraints(
    model: ModelSpec,
    parallelism: Parallelism,
    *,
    global_batch: int,
    seq_len: int,
    assumptions: Assumptions | None = None,
):
    """The divisibility rules `parallelism` breaks (empty when valid), as messages.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.constraints import parallelism_constraints
      >>> from shardfuse.planner.options import Assumptions, Parallelism
      >>> errors = parallelism_constraints(models.get("llama3-8b"), Parallelism(model=3),
      ...                                  global_batch=8, seq_len=64)
      >>> errors[0]
      'heads=32 % model=3 != 0'
    """
    P, D, F, E, C, T = (
        parallelism.pipeline,
        parallelism.data,
        parallelism.fsdp,
        parallelism.expert,
        parallelism.sequence,
        parallelism.model,
    )
    v, mb, m = (
        parallelism.options.virtual_stages,
        parallelism.microbatch_size,
        parallelism.options.num_microbatches,
    )
    errors = []
    if model.heads % T:
        errors.append(f"heads={model.heads} % model={T} != 0")
    for name, width in mlp_widths(model).items():
        if width % T:
            errors.append(f"{name}={width} % model={T} != 0")
    if E > 1 and not model.experts:
        errors.append(f"expert={E}: {model.name} has no mixture-of-experts block")
    elif E > 1 and model.experts % E:
        errors.append(f"experts={model.experts} % expert={E} != 0")
    if model.kv_heads % T and T % model.kv_heads:
        errors.append(f"kv_heads={model.kv_heads} and model={T}: neither divides the other")
    ring, by_model = sequence_shards(parallelism, assumptions)
    if seq_len % (ring * by_model):
        what = f" x model={T} (sequence parallelism)" if by_model > 1 else ""
        errors.append(f"seq_len={seq_len} % (sequence chunks={ring}{what}) != 0")
    if C > 1 and parallelism.cp_strategy == "ulysses":
        kv = max(model.kv_heads // T, 1)
        if (model.heads // T) % C or kv % C:
            errors.append(f"ulysses: heads per device {model.heads // T} and kv {kv} % {C}")
    if model.num_layers < P:
        errors.append(f"num_layers={model.num_layers} < pipeline={P}: a stage without layers")
    elif v > 1 and model.num_layers % (P * v):
        # (v = 1: uneven stages, `Stack(stage_layers=sf.parallel.balance_stages(...))`)
        errors.append(f"num_layers={model.num_layers} % (pipeline={P} x virtual={v}) != 0")
    if global_batch != D * F * E * mb * m:
        errors.append(
            f"global_batch={global_batch} != data x fsdp x expert x microbatch_size x microbatches"
        )
    if P > 1 and m < P:
        errors.append(f"num_microbatches={m} < pipeline={P}")
    if parallelism.options.schedule == "interleaved" and m % P:
        errors.append(f"interleaved: num_microbatches={m} % pipeline={P} != 0")
    if parallelism.options.zero == 3 and (
        model.hidden % F or any(width % F for width in mlp_widths(model).values())
    ):
        errors.append(f"zero=3: hidden={model.hidden} and the MLP widths % fsdp={F} != 0")
    if parallelism.options.prefetch and (parallelism.options.zero != 3 or F == 1 or P > 1):
        errors.append(
            f"prefetch=True needs zero=3 over fsdp > 1 and no pipeline (zero="
            f"{parallelism.options.zero}, fsdp={F}, pipeline={P})"
        )
    if parallelism.options.prefetch and parallelism.options.remat == "offload":
        errors.append("prefetch=True with remat='offload': not modelled")
    if (F > 1) != (parallelism.options.zero > 0):
        errors.append(
            f"zero={parallelism.options.zero} with fsdp={F}: ZeRO needs fsdp > 1 and fsdp > 1 ZeRO"
        )
    return errors
