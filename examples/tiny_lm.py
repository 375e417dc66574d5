"""Train a tiny causal LM on a 2x2x2 CPU mesh (data, sequence, model) with shardfuse layers.

The model and training loop are in `shardfuse/demos/tiny_lm.py` (also run by
`shardfuse demo`): embedding, `sf.layers.ParallelTransformerBlock`s (zigzag
ring attention over "sequence", tensor + sequence parallelism over "model",
batch over "data"), a column-parallel vocabulary head, optax Adam.

Usage: python examples/tiny_lm.py [--steps 30] [--layers 2]
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts

from shardfuse.cli import ArgumentParser, positive_int  # noqa: E402
from shardfuse.demos.tiny_lm import train  # noqa: E402


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])  # bad arguments: one line, exit 2
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--layers", type=positive_int, default=2)
    args = parser.parse_args(argv)
    losses = train(steps=args.steps, layers=args.layers)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
