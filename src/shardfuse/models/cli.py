"""`shardfuse generate`: text from a Hugging Face checkpoint directory.

    shardfuse generate --model DIR --prompt "Once upon a time" --max-new-tokens 32
    shardfuse generate --model DIR --tokens 1,2,3 --mesh data=2,model=4

`--prompt` needs the checkpoint's `tokenizer.json` and the `tokenizers`
package; `--tokens` takes token ids and prints ids.
"""

import math
from pathlib import Path

from shardfuse import axes
from shardfuse.cli import non_negative_int, positive_int


def add_arguments(parser):
    """Adds `shardfuse generate`'s arguments to `parser`."""
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text (needs tokenizer.json and `tokenizers`)")
    source.add_argument("--tokens", help="comma-separated prompt token ids")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=positive_int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--mesh", default=None, help="mesh axes, e.g. data=2,model=4 (default: one device)"
    )


def _mesh(text):
    """The mesh of `--mesh` (`axes.parse_mesh`), or one device."""
    import jax

    sizes = axes.parse_mesh(text) if text else {axes.DATA: 1}
    count = math.prod(sizes.values())
    if count > len(jax.devices()):
        raise ValueError(f"--mesh={text!r} needs {count} devices; {len(jax.devices())} exist")
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=jax.devices()[:count])


def _tokenizer(directory: Path):
    file = directory / "tokenizer.json"
    if not file.exists():
        raise ValueError(f"--prompt needs {file} (or pass token ids with --tokens)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--prompt needs the `tokenizers` package (or pass --tokens)") from None
    return Tokenizer.from_file(str(file))


def main(args) -> int:
    """Runs `shardfuse generate` (ValueError for bad arguments: the caller prints one line)."""
    import jax.numpy as jnp
    from flax import nnx

    from shardfuse.models import generation, hf

    directory = Path(args.model)
    tokenizer = _tokenizer(directory) if args.prompt is not None else None
    if tokenizer is not None:
        ids = tokenizer.encode(args.prompt).ids
    else:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--tokens={args.tokens!r}: expected comma-separated ints") from None
    if not ids:
        raise ValueError("the prompt is empty")
    model = hf.load_hf(directory, mesh=_mesh(args.mesh))
    out = generation.generate(
        model,
        jnp.asarray([ids], jnp.int32),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        rngs=nnx.Rngs(args.seed),
    )
    new = [int(t) for t in out[0]]
    print(tokenizer.decode(ids + new) if tokenizer is not None else ",".join(map(str, new)))
    return 0
