"""The mixture-of-experts router: float32 logits -> each token's k experts and their weights.

Routing rules of the open models (`RoutingConfig.rule`):

- "softmax" (Mixtral, Qwen2/3-MoE, DeepSeek-V2): `p = softmax(logits)`, the k largest
  `p` are the experts; their weights are those `p`, renormalised to sum to 1 when
  `normalize_top_k` (Mixtral always; Qwen's `norm_topk_prob`).
- "sigmoid" (DeepSeek-V3): `s = sigmoid(logits)`; the experts are the k largest
  `s + bias`, where `bias` (a `SelectionBias` variable, no gradient) only chooses
  experts; the weights are the chosen `s` (renormalised when `normalize_top_k`).
  The bias is updated outside the gradient from the tokens per expert
  (`update_selection_bias`: the auxiliary-loss-free balancing of DeepSeek-V3).

Group-limited routing (DeepSeek-V2/V3: `n_groups`, `topk_groups`): the experts form
`n_groups` equal groups; a group's score is its largest `p` (softmax, V2) or the sum of
its two largest `s + bias` (sigmoid, V3); only the `topk_groups` best groups compete in
the top-k. Every rule ends with the weights times `routed_scaling`.

Ties: `lax.top_k` picks the lower expert (or group) index first.

Auxiliary losses (computed over all tokens of the layer, whatever their sharding):

- Switch load balancing (Fedus et al. 2021): `E * sum_e f_e * P_e`, `f_e` the fraction of
  the `N * k` routed slots sent to expert e (no gradient), `P_e` the mean over tokens of
  the router's probability of e (softmax `p`; sigmoid: `s / sum(s)`, as DeepSeek-V3's
  balance loss). 1 for a perfectly balanced router.
- z-loss (Zoph et al. 2022, ST-MoE): `mean_tokens(logsumexp(logits) ** 2)`.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

ROUTING_RULES = ("softmax", "sigmoid")


class SelectionBias(nnx.Variable):
    """The sigmoid router's expert-selection bias `[E]`: not a parameter, no gradient."""


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """How a router turns logits into experts and weights (hashable: static in programs).

    Attributes:
      num_experts: E, >= 1.
      top_k: experts per token, `1 <= top_k <= num_experts` (and at most the experts
        of the chosen groups).
      rule: "softmax" or "sigmoid" (module docstring).
      normalize_top_k: renormalise the k weights to sum to 1.
      n_groups: None (no group limit) or the number of expert groups, dividing E.
      topk_groups: with `n_groups`, the groups each token may use, `1..n_groups`.
      routed_scaling: factor on the routed weights (DeepSeek-V3: 2.5), > 0.

    Raises:
      ValueError: any attribute outside the values above (the message names it).

    Example usage::

      >>> from shardfuse.layers.router import RoutingConfig
      >>> RoutingConfig(num_experts=8, top_k=2).rule
      'softmax'
      >>> RoutingConfig(num_experts=4, top_k=8)
      Traceback (most recent call last):
      ...
      ValueError: top_k=8 must be between 1 and num_experts=4
    """

    num_experts: int
    top_k: int
    rule: str = "softmax"
    normalize_top_k: bool = True
    n_groups: int | None = None
    topk_groups: int | None = None
    routed_scaling: float = 1.0

    def __post_init__(self):
        E, k = self.num_experts, self.top_k
        if isinstance(E, bool) or not isinstance(E, int) or E < 1:
            raise ValueError(f"num_experts={E!r} must be a positive int")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
            raise ValueError(f"top_k={k!r} must be between 1 and num_experts={E}")
        if self.rule not in ROUTING_RULES:
            raise ValueError(f"routing={self.rule!r} must be one of {ROUTING_RULES}")
        if not isinstance(self.normalize_top_k, bool):
            raise ValueError(f"normalize_top_k={self.normalize_top_k!r} must be True or False")
        if (self.n_groups is None) != (self.topk_groups is None):
            raise ValueError(
                f"n_groups={self.n_groups!r} and topk_groups={self.topk_groups!r} must be given "
                "together (group-limited routing) or both be None"
            )
        if self.n_groups is not None:
            G, g = self.n_groups, self.topk_groups
            if not isinstance(G, int) or G < 1 or E % G:
                raise ValueError(f"n_groups={G!r} must be a positive divisor of num_experts={E}")
            if not isinstance(g, int) or not 1 <= g <= G:
                raise ValueError(f"topk_groups={g!r} must be between 1 and n_groups={G}")
            if k > g * (E // G):
                raise ValueError(
                    f"top_k={k} must be at most the experts of topk_groups={g} groups "
                    f"({g * (E // G)})"
                )
        scaling = self.routed_scaling
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or scaling <= 0:
            raise ValueError(f"routed_scaling={scaling!r} must be a positive number")


def router_logits(x, kernel, bias=None):
    """`[N, F] @ [F, E] (+ bias [E])` -> float32 logits `[N, E]` (float32 inputs, HIGHEST
    precision; `bias`: gpt-oss's router bias, or None)."""
    logits = jnp.einsum(
        "NF,FE->NE",
        x.astype(jnp.float32),
        kernel.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return logits if bias is None else logits + bias.astype(jnp.float32)


def _group_limit(config: RoutingConfig, selection):
    """`selection [N, E]` with the experts outside each token's `topk_groups` best at -inf."""
    N, E = selection.shape
    G = config.n_groups
    grouped = selection.reshape(N, G, E // G)
    if config.rule == "sigmoid":  # DeepSeek-V3: the sum of each group's two best
        best = lax.top_k(grouped, min(2, E // G))[0]
        group_score = best.sum(-1)
    else:  # DeepSeek-V2: each group's best
        group_score = grouped.max(-1)
    _, groups = lax.top_k(group_score, config.topk_groups)  # [N, topk_groups]
    allowed = jnp.zeros((N, G), bool).at[jnp.arange(N)[:, None], groups].set(True)
    return jnp.where(allowed[:, :, None], grouped, -jnp.inf).reshape(N, E)


def route(config: RoutingConfig, logits, bias=None):
    """Each token's experts and weights from float32 `logits [N, E]`.

    Args:
      config: the `RoutingConfig`.
      logits: `[N, E]` float32.
      bias: the sigmoid rule's selection bias `[E]` (None: zeros); gradients stop at it.

    Returns:
      `(experts, weights, probs)`: `experts [N, k]` int32 (the best first), `weights
      [N, k]` float32 (differentiable in `logits`), `probs [N, E]` float32 (the
      probabilities the load-balancing loss averages).

    Example usage::

      >>> import jax.numpy as jnp
      >>> from shardfuse.layers.router import RoutingConfig, route
      >>> logits = jnp.array([[0.0, 2.0, 1.0, -1.0]])
      >>> experts, weights, _ = route(RoutingConfig(num_experts=4, top_k=2), logits)
      >>> experts.tolist(), round(float(weights.sum()), 6)
      ([[1, 2]], 1.0)
    """
    logits = logits.astype(jnp.float32)
    if config.rule == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        scores, selection = probs, probs
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
        b = 0.0 if bias is None else lax.stop_gradient(bias.astype(jnp.float32))
        selection = scores + b
    selection = lax.stop_gradient(selection)
    if config.n_groups is not None:
        selection = _group_limit(config, selection)
    _, experts = lax.top_k(selection, config.top_k)  # [N, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.normalize_top_k:
        weights = weights / weights.sum(-1, keepdims=True)
    return experts.astype(jnp.int32), weights * config.routed_scaling, probs


def tokens_per_expert(experts, num_experts: int):
    """`[E]` int32: how many of the routed slots `experts [N, k]` chose each expert."""
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(1)


def load_balancing_loss(counts, prob_sums, num_tokens, top_k: int):
    """Switch loss `E * sum_e f_e * P_e` from the counts `[E]` and summed probs `[E]`.

    `f_e = counts_e / (num_tokens * top_k)` (no gradient), `P_e = prob_sums_e / num_tokens`.
    """
    E = counts.shape[-1]
    f = lax.stop_gradient(counts.astype(jnp.float32)) / (num_tokens * top_k)
    return E * jnp.sum(f * prob_sums / num_tokens)


def z_loss_sum(logits):
    """`sum_tokens(logsumexp(logits) ** 2)` (divide by the tokens for the z-loss)."""
    return jnp.sum(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


def update_selection_bias(bias, tokens_per_expert, rate: float = 1e-3):
    """DeepSeek-V3's auxiliary-loss-free balancing: the bias after one step.

    `bias + rate * sign(mean(c) - c)`: an overloaded expert (more tokens than the
    mean) is made less likely to be chosen, an underloaded one more. Call it outside
    the gradient, once per step, with the tokens per expert the step routed
    (`ParallelMoE.stats`), and write the result back to the router's
    `SelectionBias`.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from shardfuse.layers.router import update_selection_bias
      >>> update_selection_bias(jnp.zeros(3), jnp.array([6, 2, 1]), rate=0.1).tolist()
      [-0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    counts = jnp.asarray(tokens_per_expert, jnp.float32)
    return bias + rate * jnp.sign(counts.mean() - counts).astype(bias.dtype)


__all__ = [
    "ROUTING_RULES",
    "RoutingConfig",
    "SelectionBias",
    "load_balancing_loss",
    "route",
    "router_logits",
    "tokens_per_expert",
    "update_selection_bias",
    "z_loss_sum",
]
