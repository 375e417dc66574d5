"""The token loss: softmax cross entropy summed over weighted tokens, and the weight sum.

One loss for the whole package: the model (`sf.models.Transformer.loss`), the
pipeline (`sf.parallel.Pipeline.loss`'s default `loss_fn`), gradient
accumulation (`sf.parallel.accumulate` takes `(sum, count)` loss functions) and
the trainer all call it. It lives in `layers` because it is a per-token
computation over the output of a layer (the vocabulary head), runs per shard
or on global arrays alike, and both `models` and `parallel` sit above
`layers` and import it downward.

Returning `(sum of weighted token losses, sum of weights)` rather than a mean
lets microbatches, pipeline stages and data shards combine into the exact
token-weighted mean of the whole batch (`sum(sums) / sum(counts)`): averaging
per microbatch would weigh a microbatch of few real tokens like a full one
(the bug of transformers#34191).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def token_loss(logits, targets, weights=None):
    """`(sum(w * ce), sum(w))` in float32: softmax cross entropy of integer targets.

    `ce = logsumexp(logits) - logits[target]` per token, computed in float32.
    A token of weight 0 (padding) contributes nothing, even where its target is
    out of range or its logits are not finite (`where`, not a product). On
    Explicit mesh axes the targets and weights are resharded like the logits'
    tokens first.

    Args:
      logits: `[..., V]` (e.g. `[B, T, V]`), any float dtype.
      targets: integer `[...]` (the logits' leading shape).
      weights: `[...]` token weights (a 0/1 mask, or any non-negative weights);
        None: every token weighs 1.

    Returns:
      `(total, count)`: float32 scalars; `total / count` is the token-weighted mean.

    Raises:
      ValueError: `targets` (or `weights`) not of the logits' leading shape.
      TypeError: `targets` not an integer array.

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.layers import token_loss
      >>> total, count = token_loss(jnp.zeros((2, 4)), jnp.array([1, 2]), jnp.ones(2))
      >>> round(float(total / count), 4), float(count)
      (1.3863, 2.0)
    """
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets has shape {tuple(targets.shape)}; expected the logits' leading shape "
            f"{tuple(logits.shape[:-1])} (logits {tuple(logits.shape)})"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets has dtype {targets.dtype}; expected an integer dtype")
    if weights is not None and tuple(weights.shape) != tuple(targets.shape):
        raise ValueError(
            f"weights has shape {tuple(weights.shape)}; expected the targets' shape "
            f"{tuple(targets.shape)}"
        )
    sharding = getattr(jax.typeof(logits), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    if any(spec):  # Explicit axes: targets (and weights) sharded like the logits' tokens
        tokens = sharding.update(spec=P(*spec[: targets.ndim]))
        targets = jax.sharding.reshard(targets, tokens)
        weights = None if weights is None else jax.sharding.reshard(weights, tokens)
    logits = logits.astype(jnp.float32)
    label = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ce = jax.nn.logsumexp(logits, axis=-1) - label
    if weights is None:
        return jnp.sum(ce), jnp.asarray(ce.size, jnp.float32)
    weights = weights.astype(jnp.float32)
    return jnp.sum(jnp.where(weights != 0, ce * weights, 0.0)), jnp.sum(weights)


__all__ = ["token_loss"]
