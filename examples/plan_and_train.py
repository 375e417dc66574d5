"""Plan a small LM for the 8 CPU devices with `sf.plan`, then train it from the plan.

The planner picks the mesh (pipeline, data, fsdp, sequence, model) and the
options (ZeRO stage, remat policy, microbatches, pipeline schedule) by
predicted step time, for the figures of an 8-GPU H100 node (CPUs have no
entry in `shardfuse.hardware`; the devices only change the ranking, not
what runs). The plan then becomes the configuration of the Llama-style
trainer of `examples/train_lm.py` (`shardfuse.train.from_plan`):
its mesh, `sf.layers.Stack` with the plan's remat policy, ZeRO through the
layers' `zero=` and `sf.parallel.ZeroOptimizer`, gradient accumulation or
`sf.parallel.Pipeline` over the plan's microbatches. The same training step
is what the planner's memory test compiles (tests/planner/test_memory.py).

Usage: python examples/plan_and_train.py [--steps 20]
"""

# A Llama-style model small enough for CPU: GQA (8 query heads, 4 key/value
# heads of 8), SwiGLU, RMSNorm, 4 layers, vocabulary 128.
MODEL = dict(vocab_size=128, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, num_layers=4)
GLOBAL_BATCH, SEQ_LEN = 16, 128


def config(steps=20, **overrides):
    """The `TrainConfig` of this example's model and batch (no mesh chosen yet)."""
    from shardfuse.models import ModelSpec
    from shardfuse.train import TrainConfig

    model = ModelSpec.tiny("plan_and_train", **MODEL)
    fields = dict(model=model, steps=steps, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN) | overrides
    return TrainConfig(**fields)


def plan_for_cpu(**restrict):
    """`sf.plan` for this model on one 8-device node (`restrict`: `sf.plan`'s options)."""
    from shardfuse.train import plan_for

    return plan_for(config(), 8, **restrict)


def train(the_plan, *, steps=20, log=print):
    """Trains the model with `the_plan` on the first 8 devices; returns the losses."""
    from shardfuse.train import Trainer, from_plan

    return Trainer(from_plan(config(steps), the_plan), log=log).run()


def main(argv=None):
    import jax

    from shardfuse.cli import ArgumentParser, positive_int

    parser = ArgumentParser(description=__doc__.splitlines()[0])  # bad arguments: one line, exit 2
    parser.add_argument("--steps", type=positive_int, default=20)
    args = parser.parse_args(argv)

    jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts
    plans = plan_for_cpu()
    for rank, p in enumerate(plans[:3], 1):
        print(f"plan {rank}: {p.summary()}")
    print(plans[0].explain())
    losses = train(plans[0], steps=args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
