"""`shardfuse profile`: profile the training example's step (or any script's) by category.

    shardfuse profile [--steps N] [--warmup W] [--trace-dir DIR] [--json PATH] [--top K]
                      [--chip NAME] [-- [SCRIPT.py] SCRIPT_FLAGS...]

    shardfuse profile -- examples/train_lm.py --mesh data=2,model=4 --layers 2
    shardfuse profile --steps 3 --json - -- --mesh data=2,model=4   # the default script

Everything after `--` is the training script and its own flags, exactly as
it would be run (`python examples/train_lm.py --mesh ...`); without a
script path it is `examples/train_lm.py`. The script is loaded as a module
and must define `make_parser()` (or `parse_args(argv)`) and `setup(args)`,
which returns its `Trainer` (`shardfuse.train.Trainer`) without
training. The profile then runs `--warmup` plus `--steps` training steps
under `jax.profiler`, and prints the category table, the collectives it saw,
the top ops, the planner's predicted terms for the same configuration
(`train_lm.estimate_for`, on `--chip`s) and advice.
"""

import importlib.util
import json
import os

DEFAULT_SCRIPT = os.path.join("examples", "train_lm.py")


def add_arguments(parser):
    """The options of `shardfuse profile` (the script and its flags come after `--`)."""
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the trace (default 2)")
    parser.add_argument(
        "--trace-dir", default=None, help="where jax.profiler writes (default: a temporary dir)"
    )
    parser.add_argument("--json", default=None, help="also write the profile as JSON ('-': stdout)")
    parser.add_argument("--top", type=int, default=10, help="ops listed (default 10)")
    parser.add_argument(
        "--chip", default="h100", help="sf.hardware chip the planner predicts for (default h100)"
    )
    parser.add_argument(
        "script",
        nargs="*",
        help="after --: the training script (default examples/train_lm.py) and its flags",
    )


def _script_path(argv: list) -> tuple[str, list]:
    """`(script, its flags)`: the first token if it is a `.py` file, else the default script."""
    if argv and argv[0].endswith(".py"):
        return argv[0], argv[1:]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    for root in (os.getcwd(), repo):
        if os.path.isfile(os.path.join(root, DEFAULT_SCRIPT)):
            return os.path.join(root, DEFAULT_SCRIPT), argv
    raise FileNotFoundError(f"no training script given and no {DEFAULT_SCRIPT} found")


def load_trainer(argv: list):
    """`(trainer, script path)` from `[SCRIPT.py] FLAGS...` (see the module docstring)."""
    path, flags = _script_path(argv)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training script {path!r} does not exist")
    spec = importlib.util.spec_from_file_location("shardfuse_profiled_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "setup"):
        raise ValueError(f"{path} defines no setup(args) returning its Trainer")
    if hasattr(module, "make_parser"):
        parser = module.make_parser()
        parser.prog = f"shardfuse profile -- {path}"
        args = parser.parse_args(flags)
    else:
        args = module.parse_args(flags)
    return module.setup(args), path


def main(args) -> int:
    """Runs `shardfuse profile`; ValueError/FileNotFoundError for bad arguments (exit 2)."""
    import jax

    from shardfuse.profile.api import profile
    from shardfuse.train import estimate_for, parallelism_of

    bounds = (("steps", args.steps, 1), ("warmup", args.warmup, 0), ("top", args.top, 1))
    for flag, value, low in bounds:
        if value < low:
            raise ValueError(f"--{flag}={value} must be >= {low}")
    trainer, path = load_trainer(list(args.script))
    config, devices = trainer.config, jax.device_count()
    parallelism = parallelism_of(config, devices)
    predicted = estimate_for(config, devices, chip=args.chip)
    mesh_text = ",".join(f"{k}={v}" for k, v in trainer.mesh.shape.items() if v > 1) or "1 device"
    label = f"sf.planner cost for {args.chip} x {devices}, {mesh_text}; its times are the chip's"
    step, step_args = trainer.step_call()
    with jax.set_mesh(trainer.mesh):
        report = profile(
            step,
            *step_args,
            steps=args.steps,
            warmup=args.warmup,
            trace_dir=args.trace_dir,
            predicted=predicted,
            predicted_label=label,
            parallelism=parallelism,
            devices_per_node=jax.local_device_count(),  # one host: one node
            seq_len=config.seq_len,
            top=args.top,
        )
    print(f"shardfuse profile: {path} on {mesh_text} ({jax.default_backend()})", flush=True)
    print(report.table(), flush=True)
    if args.json:
        payload = json.dumps(report.to_json(), indent=1)
        if args.json == "-":
            print(payload)
        else:
            with open(args.json, "w") as f:
                f.write(payload)
    return 0
