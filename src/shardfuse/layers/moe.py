"""Mixture of experts with expert parallelism: `ParallelMoE`.

Each token goes through the `top_k` SwiGLU experts its router picks
(`shardfuse.layers.router`: softmax or sigmoid rules, group-limited top-k, routed
scaling), weighted by the router, plus optional shared experts every token uses
(DeepSeek, Qwen2-MoE; optionally scaled by a sigmoid gate, Qwen2-MoE). Per shard:

1. route the device's tokens (float32 logits) and list the `A = tokens x k` routed
   slots, sorted by expert (`argsort`, stable); under a `capacity_factor` the slots
   past an expert's capacity are dropped (counted);
2. expert parallelism (the `expert` mesh axis, size EP > 1): each slot's row goes to
   the device holding its expert and back (`shardfuse.collectives.expert_dispatch`:
   `lax.ragged_all_to_all` on GPU/TPU, a padded dense `all_to_all` on CPU: with fused
   SwiGLU experts in chunks of twice a destination's balanced share of the rows,
   `capped_expert_parallel`, the full-size dispatch where some destination would get
   more, agreed on in the statistics' all-reduce);
3. the local experts as two grouped matmuls over the sorted rows (`sf.grouped_matmul`
   with `group_offset`: the first local expert), expert tensor parallelism over the
   `model` axis inside each expert (`expert_hidden` split, partial sums reduced once
   per token with the shared experts'); on the CPU, SwiGLU experts without biases run
   fused (`native_cpu.swiglu_experts`: the receive side's sort, both grouped matmuls, the
   activation and the unsort as one C++ custom call each way);
4. unsort, and combine each token's k results with its router weights.

Checkpoint names (for remat policies): "moe_dispatch" (the received rows), "moe_up",
"moe_down" (the grouped matmuls' outputs), "moe_combine" (the rows brought back).

Nothing is tokens x experts x F: the buffers are `A x F` (one device) or `EP x A x F`
(the dispatch's receive buffer; `EP x 2A/EP x F` in the CPU's capped dispatch).
Dropless by default (every slot computed).

Capacity (`capacity_factor=c`): each expert takes at most `ceil(c * n * k / E)` slots
of the `n` tokens one device routes (its batch and sequence shard), slot-major
priority (every token's first choice before any second choice, GShard), token order
inside a slot. Dropped slots add nothing (the token keeps its other experts, the
shared experts, and the residual outside); their count is `dropped_tokens`.

Auxiliary outputs, over all tokens of the call (`MoEStats` variables of the layer,
written by every call; `moe_stats(model)` sums them over a model's MoE layers):
`load_balancing_loss` (Switch), `router_z_loss`, `tokens_per_expert [E]` (before the
capacity), `dropped_tokens`. Add the losses to the training loss inside the
differentiated function::

    def loss_fn(model, x, y):
        out = model(x)
        stats = sf.layers.moe.moe_stats(model)
        return task_loss(out, y) + 1e-2 * stats["load_balancing_loss"] \\
            + 1e-3 * stats["router_z_loss"]
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse.collectives import expert_dispatch
from shardfuse.collectives.expert_dispatch import take_rows
from shardfuse.kernels.grouped_matmul import native_cpu as native_cpu_gmm
from shardfuse.kernels.grouped_matmul.api import grouped_matmul
from shardfuse.kernels.vma import match_varying
from shardfuse.layers import _sharding
from shardfuse.layers import fsdp as fsdp_lib
from shardfuse.layers import options as options_lib
from shardfuse.layers import router as router_lib
from shardfuse.layers.linear import default_kernel_init
from shardfuse.layers.mlp import activate
from shardfuse.layers.moe_capped import capped_expert_parallel
from shardfuse.model_spec import SWIGLU_ALPHA, SWIGLU_LIMIT

EXPERT_ACTIVATIONS = ("swiglu", "swiglu_clamped")  # gated: `gate_up` holds both halves

# fan-in of a per-expert kernel `[E, in, out]`: `in` (the expert dimension is a batch)
expert_kernel_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)
STATS = ("load_balancing_loss", "router_z_loss", "tokens_per_expert", "dropped_tokens")


class MoEStats(nnx.Variable):
    """A statistic of the last call of a `ParallelMoE` (not a parameter)."""


_COUNT_SHIFT, _COUNT_MASK = 12, (1 << 12) - 1  # the int stats as float32 halves


def moe_stats(module) -> dict:
    """The `MoEStats` of every `ParallelMoE` in `module`, summed over the layers.

    Returns:
      `{"load_balancing_loss", "router_z_loss", "dropped_tokens"}` -> scalar sums, and
      `"tokens_per_expert"` -> a list, one `[E]` array per layer (in graph order; the
      L layers of a `sf.layers.Stack` in layer order).
    """
    out = {"load_balancing_loss": 0.0, "router_z_loss": 0.0, "dropped_tokens": 0}
    per_layer = []
    for _, layer in nnx.iter_graph(module):
        if isinstance(layer, ParallelMoE):
            for name in ("load_balancing_loss", "router_z_loss", "dropped_tokens"):
                # (a stacked layer, `sf.layers.Stack`, holds one value per layer: summed)
                out[name] = out[name] + jnp.sum(getattr(layer, name)[...])
            counts = layer.tokens_per_expert[...]
            # a stacked layer's `[L, E]`: one row per layer (rows split over Explicit
            # pipeline stages gathered first: a row is not a slice of one stage's shard)
            if counts.ndim == 2 and any(_sharding.canonical_spec(_explicit_spec(counts))):
                counts = jax.sharding.reshard(counts, NamedSharding(layer.mesh, P()))
            per_layer.extend(list(counts) if counts.ndim == 2 else [counts])
    out["tokens_per_expert"] = per_layer
    return out


def _explicit_spec(x) -> P:
    """The PartitionSpec in `x`'s type (its Explicit axes; P() for none)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec if isinstance(spec, P) else P()


def moe_aux_loss(module, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0):
    """`aux_loss_coef * load_balancing_loss + z_loss_coef * router_z_loss` of `module`.

    Summed over its MoE layers (`moe_stats`), as their last call wrote them: call it
    after the model's forward, inside the differentiated function, and add it to the
    mean task loss (`sf.parallel.parallelize`'s step does, with `RunOptions`'
    coefficients). 0.0 for a module without a `ParallelMoE`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> from shardfuse.layers.moe import moe_aux_loss
      >>> mesh = jax.make_mesh((2,), ("expert",))
      >>> moe = sf.layers.ParallelMoE(8, 16, num_experts=4, top_k=1, mesh=mesh,
      ...                             rngs=nnx.Rngs(0))
      >>> y = moe(jnp.ones((2, 4, 8)))  # every token alike: one expert takes all 8
      >>> moe.tokens_per_expert[...].tolist()
      [0, 0, 8, 0]
      >>> bool(moe_aux_loss(moe, aux_loss_coef=0.01) > 0.01)  # above 0.01 x 1 (balanced)
      True
    """
    if not aux_loss_coef and not z_loss_coef:
        return jnp.float32(0.0)
    stats = moe_stats(module)
    return aux_loss_coef * stats["load_balancing_loss"] + z_loss_coef * stats["router_z_loss"]


def stats_aux_loss(stats, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0):
    """`moe_aux_loss` of a pure tree of `MoEStats` values (e.g. the rows a `Stack`'s
    `apply_layers_with_stats` returns): every `load_balancing_loss` and `router_z_loss`
    leaf summed, weighted by the coefficients; a float32 scalar (0.0 for None)."""
    coefs = {"load_balancing_loss": aux_loss_coef, "router_z_loss": z_loss_coef}
    total = jnp.zeros((), jnp.float32)
    for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]:
        # the statistic's name: the last dictionary key (a Variable adds `.value` after it)
        names = [k.key for k in path if isinstance(getattr(k, "key", None), str)]
        name = names[-1] if names else None
        if coefs.get(name):
            total = total + coefs[name] * jnp.sum(leaf.astype(jnp.float32))
    return total


def sort_slots(experts, num_experts: int, capacity_factor: float | None = None):
    """`(order, sorted_experts)` of the `n x k` slots of `experts` `[n, k]`, slot-major
    (slot a is token a % n), sorted by expert (stable); over a `capacity_factor` each
    expert keeps its first `ceil(c * n * k / E)` slots, the dropped ones get expert E and
    go last."""
    n, k = experts.shape
    E = num_experts
    slot_experts = experts.T.reshape(n * k)  # slot-major: every first choice first
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * n * k / E)
        order = jnp.argsort(slot_experts, stable=True)
        sorted_e = slot_experts[order]
        counts = jnp.zeros((E,), jnp.int32).at[sorted_e].add(1)
        rank = jnp.arange(n * k) - (jnp.cumsum(counts) - counts)[sorted_e]
        keep = jnp.zeros((n * k,), bool).at[order].set(rank < capacity)
        slot_experts = jnp.where(keep, slot_experts, E)
    order = jnp.argsort(slot_experts, stable=True)
    return order, take_rows(slot_experts, order)


def combine_slots(y_sorted, order, weights):
    """The routed outputs `y_sorted` `[n x k, F]` (in `sort_slots`' order; slot order where
    `order` is None) back to their tokens, weighted by `weights` `[n, k]` and summed:
    float32 `[n, F]`."""
    n, k = weights.shape
    if order is not None:
        y_sorted = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    y_slots = y_sorted.reshape(k, n, -1)
    return jnp.einsum("NK,KNF->NF", weights, y_slots.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)  # fmt: skip


def expert_rows(bias, row_experts, offset=None):
    """Each row's expert's row of `bias` `[E_local, C]` (experts `offset ...`, all from 0
    when None), zeros for rows of an expert not held here (another shard's, or E: a dropped
    or padding slot): `[R, C]` for `row_experts` int `[R]`."""
    local = bias.shape[0]
    index = row_experts - (0 if offset is None else offset)
    held = (index >= 0) & (index < local)
    return jnp.where(held[:, None], bias[jnp.clip(index, 0, local - 1)], 0).astype(bias.dtype)


def check_dispatch_chunks(dispatch_chunks) -> None:
    """ValueError naming `dispatch_chunks` unless it is an int >= 1 (`ParallelMoE`'s and
    `RunOptions`' option).

    Example:
      >>> check_dispatch_chunks(0)
      Traceback (most recent call last):
      ...
      ValueError: dispatch_chunks=0 must be an int >= 1
    """
    ok = isinstance(dispatch_chunks, int) and not isinstance(dispatch_chunks, bool)
    if not ok or dispatch_chunks < 1:
        raise ValueError(f"dispatch_chunks={dispatch_chunks!r} must be an int >= 1")


def fused_experts(activation, implementation, rows, gate_up, down, gate_up_bias=None,
                  down_bias=None) -> bool:  # fmt: skip
    """Whether `routed_experts` runs these experts as the fused CPU kernels
    (`native_cpu.swiglu_experts`): "swiglu" experts without biases, `implementation` None
    or "native_cpu", operands the kernels run (`native_cpu.swiglu_experts_supported`). The
    fused kernels take the rows in any order (they sort by expert themselves)."""
    return (
        activation == "swiglu"
        and gate_up_bias is None
        and down_bias is None
        and implementation in (None, "native_cpu")
        and native_cpu_gmm.swiglu_experts_supported(rows, gate_up, down)
    )


def routed_experts(rows, row_experts, sizes, gate_up, down, *, act, offset=None,
                   gate_up_bias=None, down_bias=None, add_down_bias=True, implementation=None,
                   precision=None, activation=None):  # fmt: skip
    """The routed experts on `rows [R, F]` sorted by expert (`row_experts [R]`, `sizes
    [E]` their counts): `act(rows @ gate_up[e] + gate_up_bias[e]) @ down[e] + down_bias[e]`
    per row as two grouped matmuls over this shard's experts (`offset ...`; other rows are
    zero).

    `[R, F]`, partial over `model` where the kernels' hidden dimension is split over it:
    then `add_down_bias` is True on one model shard only (the bias is added once).

    Where `activation` is "swiglu" (what `act` computes), there are no biases and the
    native CPU kernels run these operands (`implementation` None or "native_cpu";
    `native_cpu.swiglu_experts_supported`), the whole is one fused custom call each way
    (`native_cpu.swiglu_experts`: the same result, the same multiply-adds, a few XLA ops
    instead of some thirty).
    """
    if fused_experts(activation, implementation, rows, gate_up, down, gate_up_bias, down_bias):
        ids = row_experts - (0 if offset is None else offset)
        y = native_cpu_gmm.swiglu_experts(rows, ids, gate_up, down)
        return checkpoint_name(y, "moe_down")
    gmm = dict(group_offset=offset, implementation=implementation, precision=precision)
    h = grouped_matmul(rows, gate_up, sizes, **gmm)  # [R, 2H/m]
    if gate_up_bias is not None:
        h = h + expert_rows(gate_up_bias, row_experts, offset).astype(h.dtype)
    h = checkpoint_name(h, "moe_up")
    y = grouped_matmul(act(h), down, sizes, **gmm)
    if down_bias is not None:
        bias = expert_rows(down_bias, row_experts, offset).astype(y.dtype)
        y = y + jnp.where(add_down_bias, bias, 0)
    return checkpoint_name(y, "moe_down")


def shared_experts(x, up, down, gate, precision, act=None):
    """The shared experts' gated activation `act` (None: SwiGLU) on `x` `[n, F]`,
    sigmoid-gated where `gate` is given: float32 `[n, F]` (partial over `model` where the
    kernels are split over it)."""
    act = act or functools.partial(activate, "swiglu")
    f32 = dict(precision=precision, preferred_element_type=jnp.float32)
    s = jnp.dot(act(jnp.dot(x, up, **f32).astype(x.dtype)), down, **f32)
    if gate is not None:
        s = jax.nn.sigmoid(jnp.dot(x, gate, **f32)) * s
    return s


class ParallelMoE(nnx.Module):
    """Mixture of SwiGLU experts, expert-parallel over `expert_axis`, tensor-parallel inside.

    Input and output `[B, T, features]`, `P(batch, sequence, None)` with batch =
    (data, fsdp, expert) (the expert axis splits tokens like a data axis), or with
    `sequence_parallel=True` `P(batch, (sequence, model), None)` (gathered over model
    before routing, reduce-scattered after). Parameters: `router` `[F, E]` `P()`
    (float32 logits whatever the dtype); `gate_up` `[E, F, 2 * H]` `P(expert, None,
    model)` (gate and up columns interleaved per hidden unit, as `ParallelMLP`);
    `down` `[E, H, F]` `P(expert, model, None)`; with shared experts `shared_up`
    `[F, 2 * S]` `P(None, model)`, `shared_down` `[S, F]` `P(model, None)`
    (`S = shared_hidden`, default `shared_experts * expert_hidden`) and, gated,
    `shared_gate` `[F, 1]` `P()`. The sigmoid rule's `selection_bias` `[E]` is a
    `router_lib.SelectionBias`. The module docstring gives the algorithm, the capacity
    rule and how to read the auxiliary losses.

    Args:
      features: model width F.
      expert_hidden: hidden width H of each expert, divisible by the model axis size.
      num_experts: E, divisible by the size of the expert axis.
      top_k: experts per token, `1 <= top_k <= num_experts`.
      routing: "softmax" or "sigmoid" (`router_lib.ROUTING_RULES`).
      normalize_top_k: renormalise the k weights (Mixtral: True; Qwen's
        `norm_topk_prob`).
      n_groups, topk_groups: group-limited routing (DeepSeek), or None.
      routed_scaling: factor on the routed weights.
      shared_experts: number of shared experts (0: none), each `expert_hidden` wide.
      shared_hidden: the shared experts' total hidden width S (None: `shared_experts *
        expert_hidden`; Qwen2-MoE's `shared_expert_intermediate_size`); with
        `shared_experts > 0` only, divisible by the model axis.
      shared_expert_gate: scale the shared experts by `sigmoid(x @ shared_gate)`.
      capacity_factor: None (dropless) or > 0: each expert's capacity per device.
      activation: the experts' (routed and shared) gated activation, "swiglu" or
        "swiglu_clamped" (gpt-oss, with `swiglu_limit` and `swiglu_alpha`:
        `sf.layers.mlp.activate`).
      expert_bias: biases on the router's logits, `router_bias` `[E]` `P()`, and on each
        routed expert's projections, `gate_up_bias` `[E, 2 * H]` `P(expert, model)`
        (interleaved as `gate_up`'s columns) and `down_bias` `[E, F]` `P(expert, None)`
        (gpt-oss); zeros at init.
      dispatch_implementation: "ragged", "dense" or None (the mesh's platform:
        `expert_dispatch.default_implementation`).
      dispatch_chunks: with expert parallelism, the routed rows' chunks (1: one): each
        chunk is dispatched, run through its experts and combined on its own (named
        scopes `moe_chunk_{c}/dispatch`, `/experts`, `/combine`), and no chunk's
        transfers depend on another's expert compute, so that where collectives run
        asynchronously (GPU, TPU) chunk c + 1's dispatch and chunk c - 1's combine
        overlap chunk c's grouped matmuls, as the collective matmuls overlap their rings.
        Each chunk is its own collective: on XLA:CPU, whose collectives are
        synchronous, more than 1 only adds rendezvous. The result equals one chunk's.
      grouped_matmul_implementation: of `sf.grouped_matmul` (None: the platform's best).
      options: the `LayerOptions` (its `expert_axis`, default "expert", is the
        expert-parallel axis where the mesh has it); the option keywords override it.
        Under `zero=3` the expert and shared kernels are sharded over fsdp on their F
        dimension too and gathered just in time (`shardfuse.layers.fsdp`); router, bias
        and gate stay replicated.
      kernel_init: of the router, the shared experts and the gate.
      expert_init: of `gate_up` and `down` (fan-in per expert).
      rngs: `nnx.Rngs`.

    Raises:
      ValueError: a bad size or option, naming it (top_k above num_experts, experts
        not divisible by the expert axis, capacity_factor <= 0, an unknown routing).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2, 2), ("expert", "model"))
      >>> moe = sf.layers.ParallelMoE(16, 32, num_experts=4, top_k=2, mesh=mesh,
      ...                             rngs=nnx.Rngs(0))
      >>> y = moe(jnp.ones((2, 8, 16)))
      >>> y.shape, y.sharding.spec, moe.gate_up[...].sharding.spec
      ((2, 8, 16), P('expert', None, None), P('expert', None, 'model'))
      >>> int(moe.tokens_per_expert[...].sum())  # 16 tokens x 2 experts
      32
    """

    @options_lib.option_keywords
    def __init__(
        self,
        features: int,
        expert_hidden: int,
        *,
        num_experts: int,
        top_k: int,
        routing: str = "softmax",
        normalize_top_k: bool = True,
        n_groups: int | None = None,
        topk_groups: int | None = None,
        routed_scaling: float = 1.0,
        shared_experts: int = 0,
        shared_hidden: int | None = None,
        shared_expert_gate: bool = False,
        capacity_factor: float | None = None,
        activation: str = "swiglu",
        swiglu_limit: float = SWIGLU_LIMIT,
        swiglu_alpha: float = SWIGLU_ALPHA,
        expert_bias: bool = False,
        dispatch_implementation: str | None = None,
        dispatch_chunks: int = 1,
        grouped_matmul_implementation=None,
        options: options_lib.LayerOptions | None = None,
        kernel_init=default_kernel_init,
        expert_init=expert_kernel_init,
        rngs: nnx.Rngs,
    ):
        self.routing_config = router_lib.RoutingConfig(
            num_experts=num_experts, top_k=top_k, rule=routing, normalize_top_k=normalize_top_k,
            n_groups=n_groups, topk_groups=topk_groups, routed_scaling=routed_scaling,
        )  # fmt: skip
        if capacity_factor is not None and (
            isinstance(capacity_factor, bool)
            or not isinstance(capacity_factor, (int, float))
            or not capacity_factor > 0
        ):
            raise ValueError(f"capacity_factor={capacity_factor!r} must be None or > 0")
        if isinstance(shared_experts, bool) or not isinstance(shared_experts, int):
            raise ValueError(f"shared_experts={shared_experts!r} must be an int >= 0")
        if shared_experts < 0:
            raise ValueError(f"shared_experts={shared_experts!r} must be an int >= 0")
        if shared_hidden is not None and (
            isinstance(shared_hidden, bool)
            or not isinstance(shared_hidden, int)
            or shared_hidden < 1
            or not shared_experts
        ):
            raise ValueError(
                f"shared_hidden={shared_hidden!r} must be None or a positive int, with "
                f"shared_experts > 0 (got shared_experts={shared_experts!r})"
            )
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} must be one of {EXPERT_ACTIVATIONS}")
        if not isinstance(expert_bias, bool):
            raise ValueError(f"expert_bias={expert_bias!r} must be True or False")
        if dispatch_implementation is not None:
            expert_dispatch.check_implementation(dispatch_implementation)
        check_dispatch_chunks(dispatch_chunks)
        options = options_lib.configure(self, options, sequence_parallel=False)
        mesh = self.mesh
        fsdp_lib.check_kernel("features", features, mesh, self.zero)
        _sharding.check_divisible("expert_hidden", expert_hidden, mesh, self.model_axis)
        _sharding.check_divisible("num_experts", num_experts, mesh, self.expert_axis)
        self.features, self.expert_hidden = features, expert_hidden
        self.num_experts, self.top_k = num_experts, top_k
        self.shared_experts, self.shared_expert_gate = shared_experts, bool(shared_expert_gate)
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.activation, self.expert_bias = activation, expert_bias
        self.swiglu_limit, self.swiglu_alpha = float(swiglu_limit), float(swiglu_alpha)
        platform = mesh.devices.flat[0].platform
        self.dispatch_implementation = (
            dispatch_implementation or expert_dispatch.default_implementation(platform)
        )
        self.grouped_matmul_implementation = grouped_matmul_implementation
        self.dispatch_chunks = dispatch_chunks
        E, F, H = num_experts, features, expert_hidden
        S = shared_experts * expert_hidden if shared_hidden is None else shared_hidden
        if S:
            _sharding.check_divisible("the shared experts' hidden width", S, mesh, self.model_axis)
        make = _sharding.param_maker(rngs, self.param_dtype, mesh)
        specs = self._kernel_specs()
        self.router = make(kernel_init, (F, E), P())
        self.gate_up = make(expert_init, (E, F, 2 * H), specs["gate_up"])
        self.down = make(expert_init, (E, H, F), specs["down"])
        self.shared_up = make(kernel_init, (F, 2 * S), specs["shared_up"]) if S else None
        self.shared_down = make(kernel_init, (S, F), specs["shared_down"]) if S else None
        self.shared_gate = make(kernel_init, (F, 1), P()) if S and shared_expert_gate else None
        zeros = nnx.initializers.zeros_init()
        self.router_bias = make(zeros, (E,), P()) if expert_bias else None
        self.gate_up_bias = make(zeros, (E, 2 * H), specs["gate_up_bias"]) if expert_bias else None
        self.down_bias = make(zeros, (E, F), specs["down_bias"]) if expert_bias else None
        replicated = NamedSharding(mesh, P())
        if routing == "sigmoid":
            bias = jax.device_put(jnp.zeros((E,), jnp.float32), replicated)
            self.selection_bias = router_lib.SelectionBias(bias)
        else:
            self.selection_bias = None
        zeros = {"tokens_per_expert": jnp.zeros((E,), jnp.int32), "dropped_tokens": jnp.int32(0)}
        for name in STATS:
            value = zeros.get(name, jnp.float32(0))
            setattr(self, name, MoEStats(jax.device_put(value, replicated)))

    # --- layout -------------------------------------------------------------------------

    def io_spec(self):
        """PartitionSpec of the `[B, T, features]` input and output."""
        sequence = _sharding.sequence_spec(
            self.sequence_axis, self.model_axis, self.sequence_parallel
        )
        return P(self.batch_axes, sequence, None)

    def _batch_axes(self) -> tuple:
        batch = self.batch_axes
        return () if batch is None else (batch,) if isinstance(batch, str) else tuple(batch)

    def _token_axes(self) -> tuple:
        """The axes the tokens are split over (each device routes its own)."""
        return self._batch_axes() + ((self.sequence_axis,) if self.sequence_axis else ())

    def token_groups(self) -> tuple[int, int]:
        """`(batch shards, sequence shards)`: how the tokens split into routing groups
        (the capacity is per group); the oracle `reference.moe` takes it."""
        batch = _sharding.axes_size(self.mesh, self._batch_axes())
        return batch, _sharding.axis_size(self.mesh, self.sequence_axis)

    def _ep(self) -> int:
        return _sharding.axis_size(self.mesh, self.expert_axis)

    def local_params(self, dtype):
        """`local`'s parameters and their specs (`param_values_and_specs`), as `ParallelMLP`."""
        return self.param_values_and_specs(dtype)

    def set_stats(self, stats: dict):
        """Writes a call's `stats` (`local`'s second output) to the `MoEStats` variables."""
        for name in STATS:
            getattr(self, name)[...] = stats[name]

    def stats_specs(self) -> dict:
        """Out-specs of `local`'s stats: replicated."""
        return {name: P() for name in STATS}

    # the dimension of each kernel that ZeRO-3 shards over fsdp (F, which model leaves whole)
    _FSDP_DIMS = {"gate_up": 1, "down": 2, "shared_up": 0, "shared_down": 1}

    def _kernel_specs(self) -> dict:
        ex, m, fsdp = self.expert_axis, self.model_axis, self.zero.param_axis
        return {
            "gate_up": P(ex, fsdp, m),
            "down": P(ex, m, fsdp),
            "shared_up": P(fsdp, m),
            "shared_down": P(m, fsdp),
            "gate_up_bias": P(ex, m),
            "down_bias": P(ex, None),
        }

    def _weight(self, name, shard, like):
        """Per shard: a kernel in `like`'s dtype, all-gathered over fsdp under zero=3."""
        if shard is None:
            return None
        return fsdp_lib.gather(self.zero, shard, self._FSDP_DIMS[name], like.dtype, like)

    def param_values_and_specs(self, dtype):
        """`[router, bias, gate_up, down, shared_up, shared_down, shared_gate, router_bias,
        gate_up_bias, down_bias]` and specs (None where the layer has no such parameter).

        The expert and shared kernels stay in `param_dtype` (cast, and under zero=3
        gathered, per shard); the gate and the expert biases are cast to `dtype`; router,
        selection bias and router bias stay float32.
        """
        get = lambda v: None if v is None else v[...]  # noqa: E731
        cast = lambda v: None if v is None else v[...].astype(dtype)  # noqa: E731
        names = ("gate_up", "down", "shared_up", "shared_down")
        values = [self.router[...], get(self.selection_bias)]
        values += [get(getattr(self, name)) for name in names] + [cast(self.shared_gate)]
        values += [get(self.router_bias), cast(self.gate_up_bias), cast(self.down_bias)]
        specs = self._kernel_specs()
        return values, [P(), P(), *(specs[name] for name in names), P(), P(),
                        specs["gate_up_bias"], specs["down_bias"]]  # fmt: skip

    # --- per shard ----------------------------------------------------------------------

    def activate(self, h):
        """The experts' activation of their up projection `h` (`sf.layers.mlp.activate`)."""
        return activate(self.activation, h, swiglu_limit=self.swiglu_limit,
                        swiglu_alpha=self.swiglu_alpha)  # fmt: skip

    def _experts(self, rows, row_experts, sizes, offset, gate_up, down, gate_up_bias,
                 down_bias):  # fmt: skip
        """The experts over `rows [R, F]` sorted by expert: `[R, F]` (partial over model)."""
        rows, gate_up, down, gate_up_bias, down_bias = match_varying(
            rows, gate_up, down, gate_up_bias, down_bias
        )
        first_model_shard = True
        if _sharding.axis_size(self.mesh, self.model_axis) > 1:
            first_model_shard = lax.axis_index(self.model_axis) == 0
        return routed_experts(
            rows, row_experts, sizes, gate_up, down, act=self.activate, offset=offset,
            gate_up_bias=gate_up_bias, down_bias=down_bias, add_down_bias=first_model_shard,
            implementation=self.grouped_matmul_implementation, precision=self.precision,
            activation=self.activation,
        )  # fmt: skip

    def _expert_parallel(self, rows, sorted_e, gate_up, down, gate_up_bias, down_bias,
                         overflow=None):  # fmt: skip
        """Rows sorted by expert -> their experts' devices -> SwiGLU -> back: `[A, F]`;
        the capped dense dispatch (`capped_expert_parallel`) where `overflow` is given
        (`_local_overflow`, agreed over the expert axis) and caps these rows."""
        E = self.num_experts
        chunk = expert_dispatch.dense_chunk(rows.shape[0], self._ep())
        if overflow is not None and chunk < rows.shape[0]:
            rows, gate_up, down = match_varying(rows, gate_up, down)
            y_sorted = capped_expert_parallel(rows, sorted_e, gate_up, down, overflow, E,
                                              self.expert_axis, chunk)  # fmt: skip
            return checkpoint_name(y_sorted, "moe_combine")
        plan_args = dict(axis_name=self.expert_axis, implementation=self.dispatch_implementation)
        with jax.named_scope("dispatch"):
            received, received_e, plan = expert_dispatch.dispatch(
                rows, sorted_e, num_experts=E, **plan_args
            )
            received = checkpoint_name(received, "moe_dispatch")
        with jax.named_scope("experts"):
            ys = self._received_experts(received, received_e, gate_up, down, gate_up_bias,
                                        down_bias)  # fmt: skip
        with jax.named_scope("combine"):
            y_sorted = expert_dispatch.combine(ys, plan, **plan_args)  # [A, F]
            return checkpoint_name(y_sorted, "moe_combine")

    def _received_experts(self, received, received_e, gate_up, down, gate_up_bias, down_bias):
        """This device's experts on the receive buffer, results in the receive order."""
        E, ep = self.num_experts, self._ep()
        # Each row's expert among this device's E / EP (the padding's E - offset is past
        # them): the grouped matmuls then take this shard's sizes with no group offset.
        local = received_e - lax.axis_index(self.expert_axis) * (E // ep)
        if self._fused_experts(received, gate_up, down, gate_up_bias, down_bias):
            # The fused kernels sort by expert themselves and skip the padding rows.
            return self._experts(received, local, None, None, gate_up, down, None, None)
        local_order = jnp.argsort(local, stable=True)
        local_e = take_rows(local, local_order)
        xs = jnp.where((local_e < E // ep)[:, None], take_rows(received, local_order), 0)
        sizes = jnp.zeros((E // ep,), jnp.int32).at[local_e].add(1, mode="drop")
        ys = self._experts(xs, local_e, sizes, None, gate_up, down, gate_up_bias, down_bias)
        # Back to the receive order (a permutation: unique indices, a plain scatter).
        return jnp.zeros_like(ys).at[local_order].set(ys, unique_indices=True)

    def _fused_experts(self, rows, gate_up, down, gate_up_bias, down_bias) -> bool:
        """Whether `routed_experts` runs these experts fused (`fused_experts`)."""
        return fused_experts(self.activation, self.grouped_matmul_implementation, rows,
                             gate_up, down, gate_up_bias, down_bias)  # fmt: skip

    def _chunk_bounds(self, A: int) -> list:
        """`dispatch_chunks` chunks of `A` consecutive sorted slots: `[(lo, hi), ...]`."""
        bounds = np.linspace(0, A, self.dispatch_chunks + 1).astype(int)
        return [(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds) if hi > lo]

    def _local_overflow(self, rows, sorted_e, gate_up, down, gate_up_bias, down_bias):
        """Where the expert-parallel segments run the capped dense dispatch (the CPU's
        dispatch, the fused experts, a chunk `expert_dispatch.dense_chunk` below the rows):
        int32 1 if one of this device's chunks would leave rows behind, else 0 (`_stats`
        sums it over the token axes); None elsewhere."""
        ep, E = self._ep(), self.num_experts
        if ep == 1 or self.dispatch_implementation != "dense":
            return None
        if not self._fused_experts(rows, gate_up, down, gate_up_bias, down_bias):
            return None
        flags = []
        for lo, hi in self._chunk_bounds(rows.shape[0]):
            chunk = expert_dispatch.dense_chunk(hi - lo, ep)
            if chunk < hi - lo:
                flags.append(expert_dispatch.overflows(sorted_e[lo:hi], num_experts=E, ep=ep,
                                                       chunk=chunk))  # fmt: skip
        return functools.reduce(jnp.maximum, flags) if flags else None

    def _sorted_experts(self, rows, sorted_e, gate_up, down, gate_up_bias, down_bias,
                        overflow=None):  # fmt: skip
        """The experts on the slots' rows sorted by expert (`sort_slots`), results in that
        order: through the expert axis where there is one."""
        E = self.num_experts
        if self._ep() > 1:
            # Chunks of consecutive sorted slots (each still sorted, the dropped rows in
            # the last): dispatched, computed and combined independently.
            chunks = []
            for c, (lo, hi) in enumerate(self._chunk_bounds(rows.shape[0])):
                with jax.named_scope(f"moe_chunk_{c}"):
                    chunk = self._expert_parallel(rows[lo:hi], sorted_e[lo:hi], gate_up, down,
                                                  gate_up_bias, down_bias, overflow)  # fmt: skip
                    chunks.append(chunk)
            return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks)
        sizes = jnp.zeros((E,), jnp.int32).at[sorted_e].add(1, mode="drop")
        return self._experts(rows, sorted_e, sizes, None, gate_up, down, gate_up_bias, down_bias)

    def local(self, x, router, bias, gate_up, down, shared_up, shared_down, shared_gate,
              router_bias=None, gate_up_bias=None, down_bias=None):  # fmt: skip
        """Per shard: `(y, stats)` for this device's tokens `x [b, t, F]`."""
        E, F = self.num_experts, self.features
        model, sp = self.model_axis, self.sequence_parallel and self.model_axis is not None
        if sp:
            x = lax.all_gather(x, model, axis=1, tiled=True)
        b, t, _ = x.shape
        n = b * t
        gate_up, down = self._weight("gate_up", gate_up, x), self._weight("down", down, x)
        shared_up = self._weight("shared_up", shared_up, x)
        shared_down = self._weight("shared_down", shared_down, x)
        xf = x.reshape(n, F)
        logits = router_lib.router_logits(xf, router, router_bias)  # [n, E] float32
        experts, weights, probs = router_lib.route(self.routing_config, logits, bias)
        unsorted = (
            self._ep() == 1
            and self.capacity_factor is None
            and self._fused_experts(xf, gate_up, down, gate_up_bias, down_bias)
        )
        overflow = None
        if unsorted:
            # The fused kernels sort by expert themselves: the slots stay in slot order.
            order, sorted_e = None, experts.T.reshape(-1)
            rows = jnp.tile(xf, (self.top_k, 1))  # [A, F]: slot a is token a % n
        else:
            order, sorted_e = sort_slots(experts, E, self.capacity_factor)
            rows = take_rows(xf, order % n)  # [A, F]: slot a is token a % n (slot-major)
            overflow = self._local_overflow(rows, sorted_e, gate_up, down, gate_up_bias,
                                            down_bias)  # fmt: skip
        # The statistics' all-reduce comes first: it also agrees on `overflow`.
        stats, overflow = self._stats(logits, experts, probs, sorted_e, n, overflow)
        if unsorted:
            y_sorted = self._experts(rows, sorted_e, None, None, gate_up, down, None, None)
        else:
            y_sorted = self._sorted_experts(rows, sorted_e, gate_up, down, gate_up_bias,
                                            down_bias, overflow)  # fmt: skip
        y = combine_slots(y_sorted, order, weights)
        if shared_up is not None:
            y = y + shared_experts(xf, shared_up, shared_down, shared_gate, self.precision,
                                   self.activate)  # fmt: skip
        y = y.astype(x.dtype).reshape(b, t, F)
        if model is not None and sp:
            y = lax.psum_scatter(y, model, scatter_dimension=1, tiled=True)
        elif model is not None:
            y = lax.psum(y, model)
        return y, stats

    def _stats(self, logits, experts, probs, sorted_e, n, overflow=None):
        """`(stats, overflow)`: the call's statistics over every token (summed over the
        token axes), and `overflow` (`_local_overflow`; None passes through) summed with
        them, the same on every device that routes these tokens.

        One float32 all-reduce carries them all (each collective is a rendezvous of every
        device; two, one per dtype, cost a tenth of a small model's step on the CPU mesh):
        the int counts travel as exact float32 halves, `c = hi * 4096 + lo` (`lo < 4096`
        per device, so the sums stay exact below 2**24 over up to 4096 devices).
        """
        E, k = self.num_experts, self.top_k
        counts = router_lib.tokens_per_expert(experts, E)
        dropped = jnp.sum(sorted_e == E, dtype=jnp.int32)[None]
        extra = [] if overflow is None else [jnp.asarray(overflow, jnp.int32)[None]]
        ints = jnp.concatenate([counts, dropped, *extra])  # [E + 1 (+ 1)]
        hi, lo = (
            (ints >> _COUNT_SHIFT).astype(jnp.float32),
            (ints & _COUNT_MASK).astype(jnp.float32),
        )
        floats = jnp.concatenate([probs.sum(0), router_lib.z_loss_sum(logits)[None]])
        packed = jnp.concatenate([floats, jnp.float32(n)[None], hi, lo])  # [3E + 4]
        token_axes = self._token_axes()
        model = self.model_axis
        # Sequence parallel: every model shard gathered the same tokens, so summing over the
        # model axis too counts each token `m` times (divided below, exactly: the integer
        # halves stay integers below 2**24) and makes the sums the same on every shard.
        over_model = self.sequence_parallel and model is not None
        axes = tuple(token_axes) + ((model,) if over_model else ())
        if axes:
            packed = lax.psum(packed, axes)
        if over_model and lax.axis_size(model) > 1:
            packed = packed / lax.axis_size(model)
        prob_sums, z, N = packed[:E], packed[E], packed[E + 1]
        n_ints = ints.shape[0]
        hi, lo = packed[E + 2 : E + 2 + n_ints], packed[E + 2 + n_ints :]
        ints = (jnp.round(hi).astype(jnp.int32) << _COUNT_SHIFT) + jnp.round(lo).astype(jnp.int32)
        counts, dropped = ints[:E], ints[E]
        stats = dict(
            load_balancing_loss=router_lib.load_balancing_loss(counts, prob_sums, N, k),
            router_z_loss=z / N,
            tokens_per_expert=counts,
            dropped_tokens=dropped,
        )
        return stats, (None if overflow is None else ints[E + 1])

    # --- calls --------------------------------------------------------------------------

    def _check(self, x):
        _sharding.check_activations(x)
        if x.ndim != 3 or x.shape[-1] != self.features:
            raise ValueError(f"x has shape {x.shape}; expected [B, T, {self.features}]")
        B, T = x.shape[:2]
        _sharding.check_divisible("batch size B", B, self.mesh, self.batch_axes)
        sequence = _sharding.sequence_spec(
            self.sequence_axis, self.model_axis, self.sequence_parallel
        )
        _sharding.check_divisible("sequence length T", T, self.mesh, sequence)

    def forward_with_stats(self, x):
        """`(y, stats)` without the input checks and without writing `MoEStats`."""
        dtype = _sharding.compute_dtype(self.dtype, x, self.gate_up[...])
        values, specs = self.param_values_and_specs(dtype)
        x = x.astype(dtype)
        spec = self.io_spec()
        local = fsdp_lib.reshard_after_forward(self.local, self.zero)
        return _sharding.shard_map_call(
            local, self.mesh, [x, *values], [spec, *specs], (spec, self.stats_specs())
        )

    def __call__(self, x):
        """`x` `[B, T, features]` -> `[B, T, features]`, sharded as `io_spec()`; writes the
        layer's `MoEStats` (`load_balancing_loss`, `router_z_loss`, `tokens_per_expert`,
        `dropped_tokens`).

        Raises:
          TypeError: `x` is not floating point.
          ValueError: wrong shape, or B / T not divisible by their mesh axes.
        """
        self._check(x)
        if x.size == 0:
            raise ValueError(f"x has shape {x.shape}: ParallelMoE needs at least one token")
        y, stats = _sharding.call_compiled(self, "forward_with_stats", x)
        self.set_stats(stats)
        return y


__all__ = [
    "STATS",
    "MoEStats",
    "ParallelMoE",
    "check_dispatch_chunks",
    "expert_kernel_init",
    "moe_aux_loss",
    "moe_stats",
    "stats_aux_loss",
]
