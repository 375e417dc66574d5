"""Activation checkpointing (rematerialization) policies by name.

A policy says which intermediate values of a layer's forward pass are saved
for the backward pass; the rest are recomputed (`jax.checkpoint`). The
layers tag their matmul outputs with `jax.ad_checkpoint.checkpoint_name`,
so the policies can name them:

| policy | saved | recomputed |
|---|---|---|
| "none" | everything autodiff keeps | nothing |
| "full" | only the layer's inputs | the whole layer |
| "selective" | linear layers' outputs (Korthikanti 2022) | norms, activations, attention |
| "dots" | every matmul output | everything else |
| "offload" | the linear layers' outputs, moved to host memory | as "selective" |
"""

import jax

POLICIES = ("none", "full", "selective", "dots", "offload")

# checkpoint_name tags of the linear layers' outputs (what "selective" keeps).
LINEAR_OUTPUT_NAMES = (
    "attention_q",
    "attention_kv",
    "attention_out",
    "mlp_up",
    "mlp_down",
)


def check_policy(policy: str) -> str:
    """Returns `policy`; ValueError naming the valid policies otherwise."""
    if policy not in POLICIES:
        raise ValueError(f"remat={policy!r} is not a remat policy; valid: {POLICIES}")
    return policy


def jax_policy(policy: str):
    """The `jax.checkpoint` policy of a named `policy` (None for "full")."""
    check_policy(policy)
    policies = jax.checkpoint_policies
    if policy == "full":
        return None
    if policy == "selective":
        return policies.save_only_these_names(*LINEAR_OUTPUT_NAMES)
    if policy == "dots":
        return policies.checkpoint_dots
    if policy == "offload":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=LINEAR_OUTPUT_NAMES,
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise AssertionError(policy)  # "none" never reaches here


def checkpoint(fn, policy: str, *, prevent_cse: bool = True):
    """`fn` wrapped in `jax.checkpoint` with the named `policy` ("none": `fn` itself).

    Args:
      fn: a function of arrays (a layer's forward, a scan body).
      policy: one of `POLICIES`.
      prevent_cse: as `jax.checkpoint`; False is safe (and faster) inside `lax.scan`.

    Returns:
      The wrapped function.

    Raises:
      ValueError: an unknown policy.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from shardfuse.layers import remat
      >>> f = remat.checkpoint(lambda x: jnp.sin(jnp.sin(x)), "full")
      >>> float(jax.grad(f)(0.0))
      1.0
    """
    if check_policy(policy) == "none":
        return fn
    return jax.checkpoint(fn, policy=jax_policy(policy), prevent_cse=prevent_cse)
