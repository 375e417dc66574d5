"""cuDNN's flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`.

For what cuDNN runs, and nothing else (each refusal is a NotImplementedError,
so dispatch hands the call to the next backend):

- no lse: cuDNN's residual is rounded to the input dtype and not
  differentiable, so `return_lse=True` (and ring attention, which merges
  per-step lse) goes elsewhere;
- masks cuDNN has: causal, and a left window under causal (cuDNN's sliding
  window), on the default positions with T == S (jax.nn aligns its causal mask
  top-left, shardfuse bottom-right: they agree only for T == S); no segment
  ids, no softcap, no explicit positions;
- bfloat16 and float16, head dims that are multiples of 8 up to 128 (256 on
  Hopper), an NVIDIA GPU with cuDNN.

Its backward is cuDNN's own (jax.nn's custom VJP).
"""

import jax
import jax.numpy as jnp

from shardfuse import hardware
from shardfuse.kernels.attention import base

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def status(platform: str):
    """`(can_run_here, why)`: an NVIDIA GPU, where jax ships cuDNN's flash attention."""
    if platform not in ("gpu", "cuda"):
        return False, f"cuDNN runs on NVIDIA GPUs; the backend is {platform!r}"
    return True, (
        "cuDNN flash attention via jax.nn: no lse, no segment ids, no softcap, causal/left "
        "window only on default positions with T == S"
    )


def refusal(config: base.AttentionConfig, q, k, q_seg, *, need_lse: bool, capability: int):
    """Why cuDNN cannot run this call on a GPU of `capability` (e.g. 90), or None: it can.

    Example:
      >>> config = base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=1.0)
      >>> q = k = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)
      >>> print(refusal(config, q, k, None, need_lse=True, capability=90))
      implementation 'cudnn' returns no float32 lse (return_lse=True, ring attention)
      >>> print(refusal(config, q, k, None, need_lse=False, capability=90))  # explicit positions
      implementation 'cudnn' aligns its causal mask top-left: ...
    """
    B, T, H, D = q.shape
    S = k.shape[1]
    if need_lse:
        return "implementation 'cudnn' returns no float32 lse (return_lse=True, ring attention)"
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"implementation 'cudnn' runs bfloat16 and float16; got {q.dtype}"
    max_head_dim = 256 if capability >= 90 else 128
    if D % 8 or D > max_head_dim:
        return (
            f"implementation 'cudnn' takes head dims that are multiples of 8 up to "
            f"{max_head_dim}; got D={D}"
        )
    if q_seg is not None:
        return "implementation 'cudnn' has no segment ids"
    if config.logit_softcap is not None:
        return "implementation 'cudnn' has no logit softcap"
    if config.window is not None and (not config.causal or config.window[0] is None):
        return (
            f"implementation 'cudnn' runs a window only as a left window under causal; got "
            f"window={config.window}, causal={config.causal}"
        )
    if config.causal and not (config.default_positions and T == S):
        return (
            "implementation 'cudnn' aligns its causal mask top-left: it runs causal masks only on "
            f"the default positions with T == S (got T={T}, S={S}, "
            f"{'default' if config.default_positions else 'explicit'} positions)"
        )
    return None


def flash_attention(config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *,
                    need_lse=True):  # fmt: skip
    """`(out [B, T, H, D], None)`: cuDNN's attention on validated inputs (no lse).

    Raises:
      NotImplementedError: what cuDNN does not run (see the module docstring).

    Example:
      On a GPU, through the public API (return_lse=False):

      >>> import jax, shardfuse as sf
      >>> q = k = v = jax.numpy.ones((1, 256, 4, 64), jax.numpy.bfloat16)
      >>> out = sf.flash_attention(q, k, v, causal=True, implementation="cudnn")  # doctest: +SKIP
    """
    if jax.default_backend() not in ("gpu", "cuda"):
        raise NotImplementedError(
            f"implementation 'cudnn' needs an NVIDIA GPU; the backend is {jax.default_backend()!r}"
        )
    reason = refusal(
        config, q, k, q_seg, need_lse=need_lse, capability=hardware.compute_capability()
    )
    if reason is not None:
        raise NotImplementedError(reason)
    window = None
    if config.window is not None:
        window = (min(config.window[0], q.shape[1]), 0)
    try:
        out = jax.nn.dot_product_attention(
            q, k, v, scale=config.scale, is_causal=config.causal, local_window_size=window,
            implementation="cudnn",
        )  # fmt: skip
    except (ValueError, NotImplementedError, RuntimeError) as e:  # cuDNN's own checks
        raise NotImplementedError(f"implementation 'cudnn': {e}") from e
    return out, None
