"""`decode_attention`: a few queries against a KV cache (flash-decoding), in the kernel registry.

`decode_attention` validates once, before anything is traced, then calls the
requested implementation (`implementation=` a name, a sequence of names tried
in order, or None for the platform's preference; see `kernels/registry.py`):
a backend that raises `NotImplementedError` (valid input it cannot handle)
hands over to the next one. Forward only: decode is inference.
"""

import jax
import jax.numpy as jnp
import numpy as np

from shardfuse.kernels import registry, vma
from shardfuse.kernels.decode_attention import base

_MODULE = "shardfuse.kernels.decode_attention."

DECODE_ATTENTION = registry.register(
    "decode_attention",
    description=(
        "flash-decoding: a few queries against a KV cache with per-row lengths, chunks merged "
        "by lse (forward only)"
    ),
    backends=[
        registry.Backend(
            "reference",
            _MODULE + "reference",
            "decode_attention",
            "the oracle: plain jnp, float32 [B, H, T, S] scores, no chunks",
        ),
        registry.Backend(
            "xla",
            _MODULE + "xla",
            "decode_attention",
            "chunked (split-K) jnp: one batched einsum over cache chunks, merged by lse",
        ),
        registry.Backend(
            "pallas_tpu",
            _MODULE + "pallas_tpu",
            "decode_attention",
            "Pallas TPU (Mosaic) kernel: one grid step per cache chunk, empty chunks not copied",
            registry.pallas_tpu_status,
        ),
        registry.Backend(
            "triton",
            _MODULE + "triton_gpu",
            "decode_attention",
            "Triton kernel through jax-triton: one program per (chunk, kv head), GQA rows fused",
            registry.triton_status,
        ),
    ],
    preference=registry.kernel_preference(),
)
IMPLEMENTATIONS = DECODE_ATTENTION.names
PREFERENCE = DECODE_ATTENTION.preference  # the registry's own dict: tests patch it in place


def decode_attention(
    q,
    k,
    v,
    lengths,
    *,
    window=None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    block_kv: int | None = None,
    implementation=None,
):
    """Attention of a few new queries against a KV cache with a valid length per batch row.

    The queries are the last T tokens of each row's valid prefix (their keys
    and values already written to the cache), so query t of row b sits at
    position `p = lengths[b] - T + t` and sees cache row j iff

        j < lengths[b]  and  j <= p  and  (window is None or p - j <= window[0])

    (causal among the queries; `window` as in `flash_attention`, its right
    side has no effect under causal). With `s[t, j] = cap(scale * q[t] . k[j])`:

        out[t] = sum_j softmax_j(s[t, j] over visible j) v[j],   lse[t] = log sum_j exp(s[t, j])

    It equals `flash_attention(q[b], k[b, :L], v[b, :L], causal=True,
    window=window)` for each row (L = lengths[b]), computed as flash-decoding
    (Dao et al. 2023): the cache is cut into chunks of `block_kv` rows that are
    processed in parallel, each giving a partial output and lse, merged
    exactly by lse. Rows with no visible key (a length below T, or 0) return 0
    and lse = -inf; cache rows at or beyond a row's length are never read into
    a result (NaN there is harmless). Forward only (decode is inference):
    the kernel backends define no gradient. Global arrays sharded over a mesh
    (Auto or Explicit axes) work in any layout; on an Explicit mesh the results
    are typed as q is (out like q, lse `[B, H, T]` with q's B, H and T).

    Args:
      q: `[B, T, H, D]` queries (T small, e.g. 1 to 16), float32, bfloat16 or float16.
      k: `[B, S, K, D]` key cache, same dtype, `H % K == 0` (K = 1: MQA).
      v: `[B, S, K, D]` value cache.
      lengths: int `[B]`, valid cache rows per batch row, in `[0, S]`
        (checked when not traced; traced values outside act as clipped).
      window: `(left, right)` local attention window, ints >= 0 or None.
      logit_softcap: cap the scaled logits with `softcap * tanh(x / softcap)`.
      scale: logit scale; default `1 / sqrt(D)`.
      return_lse: also return the float32 log-sum-exp `[B, H, T]`.
      block_kv: cache rows per chunk (one parallel split); default per backend.
      implementation: None (the platform's preference: pallas_tpu on TPU,
        triton on GPU, else xla, each falling back to xla), one of
        "reference", "xla", "pallas_tpu", "triton", or a sequence of them
        tried in order.

    Returns:
      `out` `[B, T, H, D]` in q's dtype, or `(out, lse)` with `return_lse=True`.

    Raises:
      ValueError: invalid shapes, head counts, lengths, window, softcap, scale,
        block_kv or implementation.
      TypeError: unsupported or mismatched dtypes, non-integer lengths.
      NotImplementedError: the named implementation cannot run these inputs
        here (with None or a sequence: none could, with each reason).

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> q = jax.random.normal(jax.random.key(0), (2, 1, 8, 64))        # one new token
      >>> k = v = jax.random.normal(jax.random.key(1), (2, 256, 2, 64))  # the cache
      >>> out, lse = sf.decode_attention(q, k, v, jnp.array([256, 17]), return_lse=True)
      >>> out.shape, lse.shape
      ((2, 1, 8, 64), (2, 8, 1))
    """
    if isinstance(lengths, (list, tuple)):
        lengths = np.asarray(lengths)
    config = base.validate(
        q,
        k,
        v,
        lengths,
        window=window,
        logit_softcap=logit_softcap,
        scale=scale,
        block_kv=block_kv,
    )
    q, k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (q, k, v))
    DECODE_ATTENTION.candidates(implementation)  # an unknown name fails before anything runs
    B, T = q.shape[:2]
    S = k.shape[1]
    if B == 0 or T == 0 or S == 0:
        return base.empty_result(q, return_lse)
    lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, S)
    q, k, v, lengths = vma.match_varying(q, k, v, lengths)

    def dispatch(q, k, v, lengths):  # under auto_axes: these arrays, not the caller's
        def call(name):
            return DECODE_ATTENTION.load(name)(config, q, k, v, lengths)

        return DECODE_ATTENTION.run(implementation, call)

    mesh = _explicit_mesh(q, k, v, lengths)
    if mesh is None:
        out, lse = dispatch(q, k, v, lengths)
    else:
        # Typed on an Explicit mesh outside shard_map, the backends' reshapes and einsums of a
        # sharded dim (a cache split over S, say) would each need an output sharding: they run
        # with those axes Auto, and the results come back typed as q (out [B, T, H, D]; lse
        # [B, H, T] as q's B, H and T), as `flash_attention` does.
        B, T, H, D = (*jax.typeof(q).sharding.spec, None, None, None, None)[:4]
        shardings = (
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(B, T, H, D)),
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(B, H, T)),
        )
        out, lse = jax.sharding.auto_axes(dispatch, axes=mesh.explicit_axes,
                                          out_sharding=shardings)(q, k, v, lengths)  # fmt: skip
    return (out, lse) if return_lse else out


def _explicit_mesh(*arrays):
    """The (abstract) mesh of the first array typed on a mesh with Explicit axes, else None."""
    for x in arrays:
        mesh = jax.typeof(x).sharding.mesh
        if mesh.explicit_axes:
            return mesh
    return None
