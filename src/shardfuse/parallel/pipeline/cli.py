"""`shardfuse pipeline`: a schedule's action table as a grid, its bubble and memory figures.

    shardfuse pipeline --schedule 1f1b -p 4 -m 8 [-v 2] [--forward-only] [--plot f.png] [--json]
    shardfuse pipeline --schedule 1f1b -p 4 -m 8 --lockstep

prints the table that `schedule_table` builds (the schedule, one action per
stage and tick), one row per stage and one column per tick, then the number
of ticks, the bubble (idle fraction of the stage-ticks) next to its closed
form, and the peak number of microbatches whose stage input each stage holds
at once. `--lockstep` prints instead the `LockstepTable` the executor runs
(an F and a B slot per stage and tick), its ticks, its lockstep work over
the bubble-free work with a backward twice a forward and no head, and its
in-flight peaks.
`--json` prints the table and figures as JSON instead; `--plot PATH` draws the
timeline chart (needs matplotlib: `pip install 'shardfuse[plot]'`).
"""

import argparse
import json
import sys

from shardfuse.cli import fail
from shardfuse.parallel.pipeline.lockstep import lockstep_table
from shardfuse.parallel.pipeline.schedule import SCHEDULES, B, F, schedule_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `shardfuse pipeline` options to its sub-parser."""
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="default 1f1b")
    parser.add_argument("-p", "--stages", type=int, default=4, help="pipeline stages (default 4)")
    parser.add_argument(
        "-m", "--microbatches", type=int, default=8, help="microbatches (default 8)"
    )
    parser.add_argument(
        "-v",
        "--virtual-stages",
        type=int,
        default=None,
        help="model chunks per stage (interleaved; default 2 there, else 1)",
    )
    parser.add_argument("--forward-only", action="store_true", help="the evaluation schedule")
    parser.add_argument(
        "--lockstep", action="store_true", help="the lockstep table the executor runs"
    )
    parser.add_argument("--json", action="store_true", help="print the table and figures as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw the timeline (needs matplotlib)")


def main(args) -> int:
    """Runs `shardfuse pipeline` with parsed arguments; returns the exit status (2: bad input)."""
    v = args.virtual_stages
    if v is None:
        v = 2 if args.schedule == "interleaved" else 1
    try:
        table = schedule_table(
            args.schedule, args.stages, args.microbatches, v, forward_only=args.forward_only
        )
    except ValueError as error:
        return fail("shardfuse pipeline", error)
    if getattr(args, "lockstep", False):
        return _print_lockstep(args, v)
    figures = table.to_dict()
    if args.plot:
        try:
            from shardfuse.parallel.pipeline.plot import plot_table
        except ImportError:  # pragma: no cover - depends on the install
            print("--plot needs matplotlib: pip install 'shardfuse[plot]'", file=sys.stderr)
            return 2
        try:
            plot_table(table, args.plot)
        except ImportError:
            print("--plot needs matplotlib: pip install 'shardfuse[plot]'", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(figures))
        return 0
    title = f"{args.schedule}: p={table.num_stages} m={table.num_microbatches}"
    title += f" v={table.virtual_stages}" if table.virtual_stages > 1 else ""
    title += " (forward only)" if table.forward_only else ""
    print(title)
    print(table.grid())
    print(f"ticks: {table.num_ticks}")
    print(f"bubble: {table.bubble:.4f} (closed form {figures['closed_form_bubble']:.4f})")
    print("peak in-flight microbatches per stage: " + " ".join(map(str, figures["peak_in_flight"])))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def _print_lockstep(args, v) -> int:
    table = lockstep_table(
        args.schedule, args.stages, args.microbatches, v, forward_only=args.forward_only
    )
    cost = {F: 1.0, B: 2.0}
    print(f"{args.schedule}: p={table.num_stages} m={table.num_microbatches} v={v} (lockstep)")
    print(table.grid())
    print(f"ticks: {table.num_ticks}")
    print(f"lockstep work / ideal (B = 2 F): {table.work(cost) / table.ideal(cost):.4f}")
    print("peak in-flight microbatches per stage: " + " ".join(map(str, table.in_flight())))
    return 0
