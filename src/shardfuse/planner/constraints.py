"""The divisibility rules a layout must keep: heads, MLP, sequence, layers, batch, ZeRO."""

from shardfuse.models import ModelShape
from shardfuse.planner.options import Layout


def layout_constraints(model: ModelShape, layout: Layout, *, global_batch: int, seq_len: int):
    """The divisibility rules `layout` breaks (empty when valid), as messages.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.constraints import layout_constraints
      >>> from shardfuse.planner.options import Layout
      >>> errors = layout_constraints(models.get("llama3-8b"), Layout(model=3), global_batch=8,
      ...                             seq_len=64)
      >>> errors[0]
      'heads=32 % model=3 != 0'
    """
    P, D, F, C, T = (layout.pipeline, layout.data, layout.fsdp, layout.sequence, layout.model)
    v, mb, m = layout.virtual_stages, layout.microbatch_size, layout.num_microbatches
    errors = []
    if model.heads % T:
        errors.append(f"heads={model.heads} % model={T} != 0")
    if model.ffn_hidden % T:
        errors.append(f"ffn_hidden={model.ffn_hidden} % model={T} != 0")
    if model.kv_heads % T and T % model.kv_heads:
        errors.append(f"kv_heads={model.kv_heads} and model={T}: neither divides the other")
    ring = 2 * C if C > 1 and layout.cp_strategy != "ulysses" else C
    if seq_len % (ring * T):
        errors.append(f"seq_len={seq_len} % (sequence chunks={ring} x model={T}) != 0")
    if C > 1 and layout.cp_strategy == "ulysses":
        kv = max(model.kv_heads // T, 1)
        if (model.heads // T) % C or kv % C:
            errors.append(f"ulysses: heads per device {model.heads // T} and kv {kv} % {C}")
    if model.num_layers % (P * v):
        errors.append(f"num_layers={model.num_layers} % (pipeline={P} x virtual={v}) != 0")
    if global_batch != D * F * mb * m:
        errors.append(
            f"global_batch={global_batch} != data x fsdp x microbatch_size x microbatches"
        )
    if P > 1 and m < P:
        errors.append(f"num_microbatches={m} < pipeline={P}")
    if layout.schedule == "interleaved" and m % P:
        errors.append(f"interleaved: num_microbatches={m} % pipeline={P} != 0")
    if layout.zero == 3 and (model.hidden % F or model.ffn_hidden % F):
        errors.append(f"zero=3: hidden={model.hidden} and ffn_hidden % fsdp={F} != 0")
    if (F > 1) != (layout.zero > 0):
        errors.append(f"zero={layout.zero} with fsdp={F}: ZeRO needs fsdp > 1 and fsdp > 1 ZeRO")
    return errors
