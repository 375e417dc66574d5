"""`shardfuse plan`: the fastest mesh and options for a model on a cluster, as a table or JSON.

    shardfuse plan --model llama3-70b --device h100 --nodes 8 --seq 8192 --batch 512
    shardfuse plan ... --json            # a list of plans, best first (assumptions included)
    shardfuse plan ... --explain         # every term of the best plan, why the next lost
    shardfuse plan --model palm ... --mesh data=2,fsdp=256,model=12 --microbatch-size 4 \
        --zero 3 --remat full --assumptions palm      # pin any field of the Parallelism

`--model` takes a name of `shardfuse.models` or a JSON object of
`ModelSpec` fields (`{"name": "mine", "hidden": 4096, ...}`, or `@file.json`).
"""

import argparse
import json
import sys
from pathlib import Path

from shardfuse import axes, hardware, models
from shardfuse.cli import fail
from shardfuse.planner.options import (
    CP_STRATEGIES,
    MESH_AXES,
    PRESETS,
    REMAT_POLICIES,
    SCHEDULES,
    ZERO_STAGES,
    Assumptions,
)
from shardfuse.planner.search import TIE_RULE, PlanningError, plan

EXIT_NO_PLAN = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `shardfuse plan` options to its sub-parser."""
    parser.add_argument(
        "--model",
        required=True,
        help=f"a model name ({', '.join(models.names())}) or a JSON ModelSpec (or @file.json)",
    )
    parser.add_argument(
        "--device",
        default="h100",
        help=f"accelerator: {', '.join(sorted(hardware.ALIASES))} or a key of shardfuse.hardware",
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes (8-GPU servers, TPU slices)")
    parser.add_argument(
        "--devices-per-node", type=int, help="chips per node (default: the device's)"
    )
    parser.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    parser.add_argument(
        "--batch", type=int, required=True, help="global batch (sequences per step)"
    )
    parser.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON, best first")
    parser.add_argument("--explain", action="store_true", help="print every term of the best plan")
    only = "allow only these {} (repeatable; default: all)"
    parser.add_argument("--zero", type=int, action="append", choices=ZERO_STAGES,
                        help=only.format("ZeRO stages"))  # fmt: skip
    parser.add_argument("--remat", action="append", choices=REMAT_POLICIES,
                        help=only.format("remat policies"))  # fmt: skip
    parser.add_argument("--schedule", action="append", choices=SCHEDULES,
                        help=only.format("pipeline schedules"))  # fmt: skip
    parser.add_argument("--cp-strategy", action="append", choices=CP_STRATEGIES,
                        help=only.format("context-parallel strategies"))  # fmt: skip
    parser.add_argument("--prefetch", choices=("off", "on", "both"), default="off",
                        help="the ZeRO-3 layer prefetch: off (default), on, or both")  # fmt: skip
    parser.add_argument("--mesh", type=parse_mesh, default={},
                        help=f"pin mesh sizes, AXIS=SIZE,... with AXIS in {', '.join(MESH_AXES)}"
                        " (the other axes are searched)")  # fmt: skip
    parser.add_argument("--microbatch-size", type=int, action="append",
                        help=only.format("microbatch sizes (sequences per replica)"))  # fmt: skip
    parser.add_argument("--virtual-stages", type=int, action="append",
                        help=only.format("virtual stages (interleaved; any that divides the "
                                         "layers of a stage)"))  # fmt: skip
    parser.add_argument("--assumptions", choices=tuple(PRESETS), default="shardfuse",
                        help="assumptions preset: the system whose efficiency, overlap and "
                        "pipeline executor are assumed (default shardfuse)")  # fmt: skip
    parser.add_argument(
        "--efficiency",
        type=float,
        help="fraction of peak FLOP/s the matmuls reach (default: the device's, "
        "shardfuse.planner.efficiency)",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="bfloat16: mixed precision (default); float32: everything float32",
    )


def parse_mesh(text: str) -> dict:
    """argparse `type` of `--mesh`: `axes.parse_mesh`, its error as argparse's; the
    planner's axes (`MESH_AXES`: the expert axis among them) accepted.

    Example:
      >>> from shardfuse.planner.cli import parse_mesh
      >>> parse_mesh("pipeline=2, model=4")
      {'pipeline': 2, 'model': 4}
      >>> parse_mesh("expert=8,data=2")
      {'expert': 8, 'data': 2}
    """
    # Until `axes.MESH_AXES` holds the expert axis (issue 44's layers), its size is read
    # here and the rest by `axes.parse_mesh`.
    sizes, rest = {}, []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = (x.strip() for x in part.partition("="))
        if name in MESH_AXES and name not in axes.MESH_AXES:
            if not value.isdigit() or int(value) < 1:
                raise argparse.ArgumentTypeError(
                    f"--mesh entry {part!r} must be AXIS=SIZE with AXIS in {MESH_AXES}"
                )
            sizes[name] = int(value)
        else:
            rest.append(part)
    try:
        parsed = axes.parse_mesh(",".join(rest))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return {**sizes, **parsed} if sizes else parsed


def load_model(text: str) -> models.ModelSpec:
    """A model from a name, a JSON object of `ModelSpec` fields, or `@path` to one.

    Raises:
      ValueError: unknown name, bad JSON or bad fields (named).

    Example:
      >>> from shardfuse.planner.cli import load_model
      >>> load_model('{"name": "m", "hidden": 64, "heads": 4, "kv_heads": 4, "head_dim": 16, '
      ...            '"ffn_hidden": 256, "num_layers": 2, "vocab_size": 100}').hidden
      64
    """
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    if not text.lstrip().startswith("{"):
        return models.get(text)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--model is neither a model name nor valid JSON: {error}") from None
    try:
        return models.ModelSpec(**fields)
    except TypeError as error:
        raise ValueError(f"--model JSON: {error}") from None


MESH_HEADER = f"mesh ({' '.join(axis[0] for axis in MESH_AXES)})"  # "mesh (p d f e s m)"
COLUMNS = (
    f"columns: # rank; mesh sizes ({' '.join(MESH_AXES)}); options (ZeRO stage, "
    "remat policy, microbatch size x microbatches, schedule/virtual stages, context-parallel "
    "strategy); step s: predicted seconds per step; MFU: model FLOPs / (devices x peak x step); "
    "GB/dev: predicted peak memory per device; terms: every time term in seconds, "
    "communication as exposed/total (the rest hidden behind compute)"
)


def table(plans) -> str:
    """The plans as a text table: rank, mesh, options, step time, MFU, memory, every term."""
    header = (
        f"{'#':>2}  {MESH_HEADER:18} {'options':42} {'step s':>9} {'MFU':>6} "
        f"{'GB/dev':>7}  terms (s)"
    )
    lines = [header, "-" * len(header)]
    for rank, p in enumerate(plans, 1):
        mesh = " ".join(str(v) for v in p.mesh_shape.values())
        terms = ", ".join(
            f"{t.name} {t.value:.3g}" + (f"/{t.total:.3g}" if t.total is not None else "")
            for t in p.estimate.time
        )
        lines.append(
            f"{rank:>2}  {mesh:18} {p.options_text():42} {p.step_time_s:9.4g} "
            f"{p.mfu:6.1%} {p.memory_bytes / 1e9:7.2f}  {terms}"
        )
    return "\n".join(lines)


def main(args) -> int:
    """Runs `shardfuse plan` on parsed `args`; 0 on success, 2 on bad input, 3 when nothing fits."""
    try:
        model = load_model(args.model)
        cluster = hardware.cluster(
            args.device, nodes=args.nodes, devices_per_node=args.devices_per_node
        )
        overrides = {}
        if args.efficiency is not None:
            overrides["compute_efficiency"] = args.efficiency
        if args.dtype == "float32":
            assumptions = Assumptions.float32(**overrides)
        else:
            assumptions = Assumptions.preset(args.assumptions, **overrides)
        plans = plan(
            model,
            cluster,
            global_batch=args.batch,
            seq_len=args.seq,
            assumptions=assumptions,
            top_k=args.top,
            zero=args.zero,
            remat=args.remat,
            schedule=args.schedule,
            cp_strategy=args.cp_strategy,
            mesh=args.mesh,
            microbatch_size=args.microbatch_size,
            virtual_stages=args.virtual_stages,
            prefetch={"off": False, "on": True, "both": (False, True)}[args.prefetch],
        )
    except PlanningError as error:
        print(f"shardfuse plan: {error}", file=sys.stderr)
        return EXIT_NO_PLAN
    except (ValueError, TypeError, OSError) as error:
        return fail("shardfuse plan", error)
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=2))
        return 0
    print(
        f"{model.name} ({model.num_params() / 1e9:.3g}B parameters) on {cluster.describe()}, "
        f"global batch {args.batch} x {args.seq} tokens"
    )
    print(table(plans))
    print(COLUMNS)
    print(f"ties: {TIE_RULE}")
    if args.explain:
        print()
        print(plans[0].explain())
        if len(plans) > 1:
            print("why the next-best lost (their step time minus #1's, by term):")
            for rank, other in enumerate(plans[1:4], 2):
                print(f"  #{rank} {other.summary()}: {other.versus(plans[0])}")
    return 0
