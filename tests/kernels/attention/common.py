"""Small attention test helpers shared beyond this directory (ring attention uses them).

The case matrix and the one test body per backend are in attention_cases.py,
attention_backends.py and test_attention_backends.py.
"""

import jax
import jax.numpy as jnp
import numpy as np


def segment_ids(key, batch, length, num_segments=3):
    """Sorted (packed-sequence style) random segment ids, int32 `[batch, length]`."""
    ids = jax.random.randint(key, (batch, length), 0, num_segments)
    return jnp.sort(ids, axis=1).astype(jnp.int32)


def naive_attention_numpy(q, k, v, mask, scale, softcap=None):
    """Per-(batch, head) loops in float64 NumPy: the oracle's own oracle.

    mask: bool `[B, T, S]`. Returns `(out [B, T, H, D], lse [B, H, T])`.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, D = q.shape
    K = k.shape[2]
    out = np.zeros((B, T, H, D))
    lse = np.full((B, H, T), -np.inf)
    for b in range(B):
        for h in range(H):
            kv_head = h // (H // K)
            for t in range(T):
                visible = np.flatnonzero(mask[b, t])
                if visible.size == 0:
                    continue
                logits = np.array([q[b, t, h] @ k[b, s, kv_head] * scale for s in visible])
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                top = logits.max()
                weights = np.exp(logits - top)
                lse[b, h, t] = top + np.log(weights.sum())
                out[b, t, h] = (weights / weights.sum()) @ v[b, visible, kv_head]
    return out, lse
