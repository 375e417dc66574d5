"""Public attention entry points; the implementations are declared in the registry.

`flash_attention` validates once, before anything is traced, then calls the
requested implementation (`implementation=` a name, a sequence of names tried
in order, or None for the platform's preference; see `kernels/registry.py`):
a backend that raises `NotImplementedError` (valid input it cannot handle:
dtype, head dim, platform) hands over to the next one. Ring attention runs
the same backends per ring step.
"""

import dataclasses

import jax

from shardfuse.kernels import registry
from shardfuse.kernels.attention import base

_MODULE = "shardfuse.kernels.attention."

# Backend modules are imported on first use only, so that optional
# dependencies (triton, jax_triton) are never imported by `import shardfuse`.
ATTENTION = registry.register(
    "attention",
    description="flash attention, GQA, masks on positions, float32 lse (and each ring step)",
    backends=[
        registry.Backend(
            "reference",
            _MODULE + "reference",
            "reference_attention",
            "the oracle: plain jnp, float32 [B, H, T, S] scores, memory O(T*S)",
        ),
        registry.Backend(
            "xla",
            _MODULE + "xla",
            "flash_attention",
            "blockwise JAX, online softmax in lax loops, custom_vjp, memory O(T+S)",
        ),
        registry.Backend(
            "pallas_tpu",
            _MODULE + "pallas_tpu",
            "flash_attention",
            "Pallas TPU (Mosaic) flash attention kernels, forward and backward",
            registry.pallas_tpu_status,
        ),
        registry.Backend(
            "triton",
            _MODULE + "triton_gpu",
            "flash_attention",
            "Triton flash attention kernels through jax-triton, forward and backward",
            registry.triton_status,
        ),
        registry.Backend(
            "mosaic_gpu",
            _MODULE + "mosaic_gpu",
            "flash_attention",
            "Pallas Mosaic GPU kernels for sm_90+ (warp-specialized, TMA, wgmma), fwd and bwd",
            registry.mosaic_gpu_status,
        ),
        registry.Backend(
            "cudnn",
            _MODULE + "cudnn",
            "flash_attention",
            "cuDNN flash attention via jax.nn (no lse, segment ids or softcap)",
            registry.cudnn_status,
            call_keywords=("need_lse",),
        ),
        registry.Backend(
            "native_cpu",
            _MODULE + "native_cpu",
            "flash_attention",
            "C++ flash attention (XLA FFI custom calls, native/), forward and backward",
            registry.native_cpu_status,
        ),
    ],
    # What `implementation=None` tries, best first, per platform. On CPU the C++ kernels
    # where built (1.5-4.4x their peers on every case of docs/kernels.md's table), else, and
    # for what they do not run (float16, head dims over 512, operands XLA partitions
    # outside shard_map), xla.
    preference=registry.kernel_preference(cpu=("native_cpu", "xla")),
    # On NVIDIA GPUs the order depends on the case: the fastest measured backend first
    # (gpu_dispatch.py, from the GPU bench's committed table).
    rule=lambda platform: _gpu_rule(platform),
)
IMPLEMENTATIONS = ATTENTION.names
PREFERENCE = ATTENTION.preference  # the registry's own dict: tests patch it in place


def _gpu_rule(platform):
    if platform not in ("gpu", "cuda"):
        return None
    from shardfuse.kernels.attention import gpu_dispatch

    return gpu_dispatch.describe(platform)


def load_implementation(name: str):
    """Returns the backend function `name`, or raises NotImplementedError saying why not."""
    return ATTENTION.load(name)


@base.config_options
def flash_attention(
    q,
    k,
    v,
    *,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    return_lse: bool = False,
    implementation=None,
    **options,
):
    """Memory-efficient multi-head attention with GQA, masks on positions and a float32 lse.

    Computes, for query head h reading kv head `h // (H // K)`:

        s[t, j] = cap(scale * q[t] . k[j]),   cap(x) = softcap * tanh(x / softcap)
        out[t] = sum_j softmax_j(s[t, j] over visible j) v[j]
        lse[t] = log sum_{visible j} exp(s[t, j])

    Key j is visible to query t iff every given mask allows it: `causal`:
    `kv_pos[j] <= q_pos[t]`; `window=(left, right)`:
    `q_pos[t] - left <= kv_pos[j] <= q_pos[t] + right` (None: unbounded side);
    segment ids: `q_segment_ids[b, t] == kv_segment_ids[b, j]`. A query with no
    visible key returns 0 and lse = -inf, with zero gradients.

    Args:
      q: `[B, T, H, D]` queries, float32, bfloat16 or float16.
      k: `[B, S, K, D]` keys, same dtype, `H % K == 0` (K = 1: MQA).
      v: `[B, S, K, D]` values.
      causal: mask keys after the query position.
      q_positions: int32 `[T]` absolute positions. Default `arange(T) + S - T`
        (bottom-right aligned, so the last query sees the last key).
      kv_positions: int32 `[S]`. Default `arange(S)`.
      q_segment_ids: int `[B, T]`; pass together with `kv_segment_ids` `[B, S]`.
      kv_segment_ids: int `[B, S]`.
      window: `(left, right)` local attention window, ints >= 0 or None.
      logit_softcap: cap the scaled logits with `softcap * tanh(x / softcap)`.
      scale: logit scale; default `1 / sqrt(D)`.
      return_lse: also return the float32 log-sum-exp `[B, H, T]`.
      implementation: None (the platform's preference: pallas_tpu on TPU; on an NVIDIA
        GPU the fastest backend measured for the case (head dim, dtype, mask, length;
        `shardfuse info` prints the rule); native_cpu on CPU where built, else xla; each
        falling back to the next and to xla), one of "reference", "xla", "pallas_tpu",
        "triton", "mosaic_gpu", "cudnn", "native_cpu", or a sequence of them tried in
        order (each NotImplementedError hands over to the next).
      block_sizes: optional `BlockSizes(block_q, block_kv)` for the tiled paths.

    Returns:
      `out` `[B, T, H, D]` in q's dtype, or `(out, lse)` with `return_lse=True`.

    Raises:
      ValueError: invalid shapes, head counts, window, softcap, scale or implementation.
      TypeError: unsupported or mismatched dtypes.
      NotImplementedError: the named implementation cannot run these inputs
        here (with None or a sequence: none could, with each reason).

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> q = jax.random.normal(jax.random.key(0), (2, 128, 8, 64))
      >>> k = v = jax.random.normal(jax.random.key(1), (2, 128, 2, 64))
      >>> out, lse = sf.flash_attention(q, k, v, causal=True, return_lse=True)
      >>> out.shape, lse.shape
      ((2, 128, 8, 64), (2, 8, 128))
    """
    config, q, k, v = base.validate_arrays(
        q, k, v, q_positions=q_positions, kv_positions=kv_positions,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **options,
    )  # fmt: skip
    ATTENTION.candidates(implementation)  # an unknown name fails before anything runs
    B, T, _, _ = q.shape
    S = k.shape[1]
    if B == 0 or T == 0 or S == 0:
        return base.empty_result(q, return_lse)
    q_pos, kv_pos = base.default_positions(T, S, q_positions, kv_positions)
    if q_positions is None and kv_positions is None:
        config = dataclasses.replace(config, default_positions=True)
    facts = {"need_lse": return_lse}

    arrays = (q, k, v, q_pos, kv_pos, q_segment_ids, kv_segment_ids)
    order = None
    if implementation is None and jax.default_backend() in ("gpu", "cuda"):
        order = gpu_preference(config, q, k, q_segment_ids)

    def call(name, arrays):
        keywords = {key: facts[key] for key in ATTENTION.backends[name].call_keywords}
        out, lse = load_implementation(name)(config, *arrays, **keywords)
        return (out, lse) if return_lse else out

    def dispatch(*arrays):  # under auto_axes: these arrays, not the caller's
        return ATTENTION.run(implementation, lambda name: call(name, arrays), order=order)

    sharding = jax.typeof(q).sharding
    if sharding.mesh.explicit_axes:
        # Typed on an Explicit mesh outside shard_map, every reshape of a sharded dim must
        # name its output sharding: the kernels run with those axes Auto, and the results
        # come back typed as q (out [B, T, H, D]; lse [B, H, T] as q's B, H and T).
        B, T, H, D = (*sharding.spec, None, None, None, None)[:4]
        P = jax.sharding.PartitionSpec
        shardings = (
            jax.sharding.NamedSharding(sharding.mesh, P(B, T, H, D)),
            jax.sharding.NamedSharding(sharding.mesh, P(B, H, T)),
        )
        shardings = shardings if return_lse else shardings[0]
        axes = sharding.mesh.explicit_axes
        return jax.sharding.auto_axes(dispatch, axes=axes, out_sharding=shardings)(*arrays)
    return dispatch(*arrays)


def gpu_preference(config, q, k, q_seg) -> tuple[str, ...]:
    """What `implementation=None` tries on this GPU for these inputs (`gpu_dispatch`)."""
    from shardfuse.hardware import compute_capability
    from shardfuse.kernels.attention import gpu_dispatch

    return gpu_dispatch.preference(config, q, k, q_seg, compute_capability())


def attention_reference(q, k, v, **options):
    """The attention oracle: the same function as `flash_attention`, computed naively.

    Materialises the `[B, H, T, S]` scores in float32 (HIGHEST precision for
    float32 inputs), applies every mask, and normalises with a safe softmax:
    rows without a visible key give 0 and lse = -inf, and their gradients
    (plain autodiff, no custom_vjp) are 0, never NaN. Keys no query can see
    are zeroed first, so NaN there never leaks. Memory O(B * H * T * S).

    Args:
      q, k, v: as `flash_attention`.
      **options: the keywords of `flash_attention` (`causal`, `q_positions`,
        `kv_positions`, `q_segment_ids`, `kv_segment_ids`, `window`,
        `logit_softcap`, `scale`, `return_lse`), with their defaults; not
        `implementation` or `block_sizes`: this is the reference implementation.

    Returns:
      As `flash_attention`.

    Raises:
      As `flash_attention`; TypeError for `implementation` or `block_sizes`.

    Example:
      >>> import jax, shardfuse as sf
      >>> q = jax.random.normal(jax.random.key(0), (1, 16, 4, 32))
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 16, 1, 32))
      >>> out = sf.attention_reference(q, k, v, causal=True, window=(4, 0))
      >>> out.shape
      (1, 16, 4, 32)
    """
    for name in ("implementation", "block_sizes"):
        if name in options:
            raise TypeError(f"attention_reference() takes no {name}=: it is the reference")
    return flash_attention(q, k, v, implementation="reference", **options)
