"""Command line: `shardfuse info | demo | bench | pipeline | plan | profile | generate`.

shardfuse info            versions, devices, usable implementations and why not
shardfuse demo            every op against its reference on 8 CPU devices
shardfuse bench           the benchmark suites (shardfuse.bench.suites): table, JSON, compare, plot
shardfuse pipeline        a pipeline schedule as a grid: ticks, bubble, in-flight microbatches
shardfuse plan            the best parallel layouts for a model on a cluster (cost model)
shardfuse profile         a training step's time by category, from a jax.profiler trace
shardfuse generate        text from a Hugging Face checkpoint (KV cache on any mesh)
"""

import sys

from shardfuse.cli import ArgumentParser


def _use_cpu_devices(count: int) -> None:
    """Ask for `count` CPU devices; must run before any JAX backend starts."""
    import jax

    jax.config.update("jax_num_cpu_devices", count)


def main(argv=None) -> int:
    parser = ArgumentParser(prog="shardfuse", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cpu-devices", type=int, default=8, help="number of CPU devices to simulate (default 8)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, backend, devices, usable implementations")
    demo = commands.add_parser("demo", help="run every op against its reference")
    demo.add_argument("--seq-len", type=int, default=512, help="sequence length (default 512)")
    from shardfuse.bench import cli as bench_cli

    bench_cli.add_arguments(commands.add_parser("bench", help="run the benchmark suites"))
    from shardfuse.parallel.pipeline import cli as pipeline_cli
    from shardfuse.planner import cli as plan_cli

    pipeline_cli.add_arguments(
        commands.add_parser("pipeline", help="show a pipeline schedule: grid, bubble, memory")
    )
    plan_cli.add_arguments(
        commands.add_parser("plan", help="rank parallel layouts for a model on a cluster")
    )
    from shardfuse.profile import cli as profile_cli

    profile_cli.add_arguments(
        commands.add_parser("profile", help="a training step's time by category (jax.profiler)")
    )
    from shardfuse.models import cli as generation_cli

    generation_cli.add_arguments(
        commands.add_parser("generate", help="text from a Hugging Face checkpoint directory")
    )
    args = parser.parse_args(argv)
    if args.cpu_devices < 1:
        parser.error(f"--cpu-devices={args.cpu_devices} must be >= 1")
    _use_cpu_devices(args.cpu_devices)

    if args.command == "info":
        from shardfuse._info import info

        info()
    elif args.command == "demo":
        if args.seq_len < 1:
            parser.error(f"--seq-len={args.seq_len} must be >= 1")
        from shardfuse import demos

        demos.run(seq_len=args.seq_len)
    elif args.command in ("bench", "pipeline", "plan", "profile", "generate"):
        clis = {"bench": bench_cli, "pipeline": pipeline_cli, "plan": plan_cli,
                "generate": generation_cli}  # fmt: skip
        cli = clis.get(args.command, profile_cli)
        try:
            return cli.main(args)
        except (ValueError, FileNotFoundError) as e:
            parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
