"""What the grouped matmul benchmarks measure: MoE shapes, routings, and the contenders.

One home for the suite (`suites/bench_grouped_matmul.py`) and the peers tool
(`tools/grouped_matmul_peers.py`), so that both time the same cases the same way.

Shapes are two mixture-of-experts layers' expert up-projections, `lhs [M, K]` (the
routed tokens, `M = tokens x top_k`, sorted by expert) by `rhs [G, K, N]`:

- `mixtral-8x7b`: 8 experts, top 2, hidden 4096, expert hidden 14336 (Mistral AI,
  arXiv:2401.04088);
- `olmoe-1b-7b`: 64 small experts, top 8, hidden 2048, expert hidden 1024
  (Muennighoff et al., arXiv:2409.02060);

with the widths divided by the run's scale divisor (8 on CPU) and a number of
tokens per scale. Routings: `balanced` (every expert M / G rows) and `skewed`
(Zipf, exponent 1.2: an untrained router's imbalance; the largest expert gets
43% of the rows of the 8-expert layer, 30% of the 64-expert one's).

Contenders, each `(lhs, rhs, sizes) -> out [M, N]` in the inputs' dtype with
float32 accumulation (HIGHEST precision for float32):

- `shardfuse` (`sf.grouped_matmul`, the platform's default) and `shardfuse.<impl>`;
- `jax.lax.ragged_dot`; `tokamax.ragged_dot` (its platform default);
- `one_hot_dense`: every expert on every row, combined with a one-hot `[M, G]` mask
  (what many MoE codes still do; G times the FLOPs, a `[G, M, N]` temporary);
- `dense_matmul`, the roofline: one `[M, K] @ [K, N]`, the same FLOPs as the grouped
  matmul (called with `rhs[0]` as its `[K, N]`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardfuse.kernels.grouped_matmul import grouped_matmul

ROUTINGS = ("balanced", "skewed")
ZIPF_EXPONENT = 1.2
DENSE = "dense_matmul"
PEERS = ("jax.lax.ragged_dot", "tokamax.ragged_dot", "one_hot_dense")
# Tokens routed per layer call, by scale (M = tokens x top_k rows).
TOKENS = {"cpu": 1024, "cpu-quick": 128, "device": 16384, "device-quick": 4096}


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """One MoE layer's experts: `experts` of `[hidden, expert_hidden]`, each token to `top_k`."""

    name: str
    experts: int
    top_k: int
    hidden: int
    expert_hidden: int

    def scaled(self, divisor: int) -> "MoeShape":
        """The widths divided by `divisor` (experts and top-k kept)."""
        return dataclasses.replace(
            self,
            hidden=max(1, self.hidden // divisor),
            expert_hidden=max(1, self.expert_hidden // divisor),
        )


MOE_SHAPES = {
    "mixtral-8x7b": MoeShape("mixtral-8x7b", experts=8, top_k=2, hidden=4096, expert_hidden=14336),
    "olmoe-1b-7b": MoeShape("olmoe-1b-7b", experts=64, top_k=8, hidden=2048, expert_hidden=1024),
}


def group_sizes(rows: int, groups: int, routing: str, seed: int = 0) -> np.ndarray:
    """int32 `[groups]` rows per expert summing to `rows`: `balanced` or Zipf-`skewed`.

    Example:
      >>> group_sizes(10, 4, "balanced").tolist()
      [3, 3, 2, 2]
      >>> int(group_sizes(1000, 8, "skewed").max()) > 250
      True
    """
    if routing == "balanced":
        return np.array([rows // groups + (i < rows % groups) for i in range(groups)], np.int32)
    if routing != "skewed":
        raise ValueError(f"routing={routing!r} is not one of {ROUTINGS}")
    weights = 1.0 / np.arange(1, groups + 1) ** ZIPF_EXPONENT
    sizes = np.random.default_rng(seed).multinomial(rows, weights / weights.sum())
    return sizes.astype(np.int32)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def one_hot_dense(lhs, rhs, sizes):
    """Every expert on every row, then the one-hot combine: `[G, M, N]` and G x the FLOPs."""
    M = lhs.shape[0]
    expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(M), side="right")  # [M]
    mask = jax.nn.one_hot(expert, rhs.shape[0], dtype=jnp.float32)  # [M, G]; past the sum: 0
    every = jnp.einsum(
        "MK,GKN->GMN", lhs, rhs, precision=_precision(lhs.dtype), preferred_element_type=jnp.float32
    )
    return jnp.einsum("MG,GMN->MN", mask, every).astype(lhs.dtype)


def contender(name: str):
    """`(lhs, rhs, sizes) -> out` of contender `name` (see the module docstring).

    Raises:
      ImportError: `tokamax.ragged_dot` without tokamax (`pip install -e ".[peers]"`).
      ValueError: an unknown name.
    """
    if name == "shardfuse" or name.startswith("shardfuse."):
        implementation = None if name == "shardfuse" else name.removeprefix("shardfuse.")
        return lambda lhs, rhs, sizes: grouped_matmul(
            lhs, rhs, sizes, implementation=implementation
        )
    if name == "jax.lax.ragged_dot":
        return lambda lhs, rhs, sizes: lax.ragged_dot(
            lhs, rhs, sizes, precision=_precision(lhs.dtype), preferred_element_type=jnp.float32
        ).astype(lhs.dtype)
    if name == "tokamax.ragged_dot":
        from shardfuse.bench.tools.peers import import_tokamax

        tokamax = import_tokamax()
        return lambda lhs, rhs, sizes: tokamax.ragged_dot(
            lhs, rhs, sizes, precision=_precision(lhs.dtype), preferred_element_type=jnp.float32
        ).astype(lhs.dtype)
    if name == "one_hot_dense":
        return one_hot_dense
    if name == DENSE:
        return lambda lhs, w: jnp.dot(
            lhs, w, precision=_precision(lhs.dtype), preferred_element_type=jnp.float32
        ).astype(lhs.dtype)
    raise ValueError(f"contender {name!r} is unknown")


def inputs(shape: MoeShape, tokens: int, routing: str, dtype, seed: int = 0):
    """`(lhs [M, K], rhs [G, K, N], sizes [G], cotangent [M, N])` for one case, O(1) outputs."""
    M, K, N = tokens * shape.top_k, shape.hidden, shape.expert_hidden
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(keys[0], (M, K), dtype)
    rhs = (jax.random.normal(keys[1], (shape.experts, K, N)) * K**-0.5).astype(dtype)
    cotangent = jax.random.normal(keys[2], (M, N), dtype)
    return lhs, rhs, jnp.asarray(group_sizes(M, shape.experts, routing, seed)), cotangent
