"""Activation checkpointing (rematerialization) policies by name.

A policy says which intermediate values of a layer's forward pass are saved
for the backward pass; the rest are recomputed (`jax.checkpoint`). The
layers' per-shard functions tag their matmul outputs with
`jax.ad_checkpoint.checkpoint_name`, so the policies can name them:

| policy | saved | recomputed |
|---|---|---|
| "none" | everything autodiff keeps | nothing |
| "full" | only the layer's inputs | the whole layer |
| "selective" | the projections' outputs | norms, activations, RoPE, attention core |
| "dots" | every matmul output (projections, attention core) | norms, activations, RoPE |
| "offload" | as "selective", moved to host memory (`pinned_host`) | as "selective" |

"selective" is Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models"): keep what is expensive to recompute and
cheap to store, recompute the attention core (softmax and its inputs) and
the element-wise work. Names a layer tags:

- `attention_q`, `attention_kv`: the fused QKV projection's query and
  key/value columns (before RoPE);
- `attention_core`: the attention output (the product with V);
- `attention_out`: the output projection;
- `mlp_up`, `mlp_down`: the MLP's projections; `linear`: a lone linear layer;
- `moe_up`, `moe_down`: a `ParallelMoE`'s expert grouped matmuls; `moe_dispatch`,
  `moe_combine`: its rows after the all-to-alls (kept, the backward does not send them again);
- `fsdp_gather`: a ZeRO-3 weight gathered over fsdp (never saved while the
  layer reshards after the forward, see `shardfuse.layers.fsdp`).

Every policy works inside `nnx.scan` / `lax.scan` (the policy is part of the
scanned body's jaxpr), which is how `sf.layers.Stack` applies it.

Activation memory. The attention core is blockwise (flash): no policy
stores a `[T, S]` score matrix, so "selective" gains what Korthikanti et
al. gain apart from the `s^2` terms: the norms' float32 internals, RoPE'd q
and k, the attention output and statistics, and the MLP's element-wise
intermediates. Saved activation bytes, none / selective (per token, any T;
`tests/layers/test_remat.py`): SwiGLU blocks 2.84x in float32, 3.19x with
bfloat16 compute; GELU/LayerNorm blocks 3.90x in float32. "full" keeps the
block input only (26-38x less). What one more layer adds to the compiled
temp memory of a `Stack`'s grad step is 3.4-4.1x less under "selective"
(under "none" the scan also keeps a copy of each layer's weights);
`shardfuse/bench/suites/bench_memory.py` has the table.
"""

import warnings

import jax

from shardfuse import flops
from shardfuse.flops import check_remat
from shardfuse.layers import fsdp

# checkpoint_name tags of the linear layers' outputs (what "selective" keeps).
LINEAR_OUTPUT_NAMES = (
    "attention_q",
    "attention_kv",
    "attention_out",
    "mlp_up",
    "mlp_down",
    "linear",
    "moe_up",
    "moe_down",
    "moe_dispatch",
    "moe_combine",
)
ATTENTION_CORE_NAME = "attention_core"
# every matmul output (what "dots" keeps)
MATMUL_OUTPUT_NAMES = (*LINEAR_OUTPUT_NAMES, ATTENTION_CORE_NAME)


def offload_supported(device=None) -> tuple[bool, str]:
    """Whether `device` (default: the first) has the `pinned_host` memory "offload" moves to.

    Returns `(supported, reason)`; the reason says what is missing.
    """
    device = jax.devices()[0] if device is None else device
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except Exception as error:  # a backend without memory spaces
        return False, f"{device.platform} device has no memory kinds ({error})"
    if "pinned_host" not in kinds:
        return False, f"{device.platform} device memories {sorted(kinds)} lack pinned_host"
    return True, ""


def jax_policy(policy: str):
    """The `jax.checkpoint` policy of a named `policy` (None for "full")."""
    check_remat(policy)
    policies = jax.checkpoint_policies
    if policy == "full":
        return None
    if policy == "selective":
        return policies.save_only_these_names(*LINEAR_OUTPUT_NAMES)
    if policy == "dots":
        return policies.save_only_these_names(*MATMUL_OUTPUT_NAMES)
    if policy == "offload":
        supported, reason = offload_supported()
        if not supported:
            raise NotImplementedError(
                f'remat="offload" saves the matmul outputs in host memory, but the {reason}; '
                'use remat="selective" (same recomputation, saved on the device)'
            )
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=LINEAR_OUTPUT_NAMES,
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise AssertionError(policy)  # "none" never reaches here


def _keeping_gathered(policy):
    """`policy`, extended to save the gathered ZeRO-3 weights too."""

    def keep(primitive, *avals, **params):
        if fsdp.is_gathered(primitive, **params):
            return True
        return False if policy is None else policy(primitive, *avals, **params)

    return keep


def checkpoint(fn, policy: str, *, prevent_cse: bool = True, zero=None):
    """`fn` wrapped in `jax.checkpoint` with the named `policy` ("none": `fn` itself).

    With `zero` (a layer's `fsdp.ZeroOptions`) at stage 3, gathered weights
    follow `zero.reshard_after_forward`: True, never saved (under "none" too:
    then every other value is saved); False, always saved.

    Args:
      fn: a function of arrays (a layer's forward, a scan body).
      policy: one of `REMAT_POLICIES` (the list: `shardfuse.flops`).
      prevent_cse: as `jax.checkpoint`; False is safe (and faster) inside `lax.scan`.
      zero: None, or the `shardfuse.layers.fsdp.ZeroOptions` of the layer `fn` runs.

    Returns:
      The wrapped function.

    Raises:
      ValueError: an unknown policy.
      NotImplementedError: "offload" on a device without `pinned_host` memory.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from shardfuse.layers import remat
      >>> f = remat.checkpoint(lambda x: jnp.sin(jnp.sin(x)), "full")
      >>> float(jax.grad(f)(0.0))
      1.0
    """
    gathered = zero is not None and zero.param_axis is not None
    if check_remat(policy) == "none":
        return fsdp.reshard_after_forward(fn, zero) if gathered else fn
    jax_fn_policy = jax_policy(policy)
    if gathered and not zero.reshard_after_forward:
        jax_fn_policy = _keeping_gathered(jax_fn_policy)
    return jax.checkpoint(fn, policy=jax_fn_policy, prevent_cse=prevent_cse)


# Names of earlier releases: the list and its check live in `shardfuse.flops`.
_DEPRECATED = {"POLICIES": ("REMAT_POLICIES", "sf.flops.REMAT_POLICIES"),
               "check_policy": ("check_remat", "sf.flops.check_remat")}  # fmt: skip


def __getattr__(name):
    if name in _DEPRECATED:
        attribute, instead = _DEPRECATED[name]
        warnings.warn(
            f"sf.layers.remat.{name} is deprecated and will be removed in the next release: "
            f"use {instead}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(flops, attribute)
    raise AttributeError(f"module 'shardfuse.layers.remat' has no attribute {name!r}")
