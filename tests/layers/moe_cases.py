"""Shared pieces of the MoE tests: configurations drawn from the whole option space, meshes,
and the comparison of one configuration with the dense one-device oracle."""

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

import shardfuse as sf
from shardfuse.layers import reference
from shardfuse.layers.moe import moe_stats
from shardfuse.testing import assert_close
from tests.layers.common import assert_sharded_as, assert_trees_close

# (axis sizes) the generator draws from: expert x data x fsdp x sequence x model, <= 8 devices
MESHES = (
    {},
    {"expert": 2},
    {"expert": 4},
    {"expert": 8},
    {"expert": 2, "data": 2},
    {"expert": 2, "model": 2},
    {"expert": 4, "model": 2},
    {"expert": 2, "data": 2, "model": 2},
    {"expert": 2, "fsdp": 2, "model": 2},
    {"data": 2, "fsdp": 2, "expert": 2},
    {"expert": 2, "sequence": 2, "model": 2},
    {"data": 2, "model": 2},
)
ORDER = ("data", "fsdp", "expert", "sequence", "model")
AUX = {"load_balancing_loss": 0.3, "router_z_loss": 0.07}  # coefficients of the aux losses


@dataclasses.dataclass(frozen=True)
class Case:
    mesh: tuple  # ((axis, size), ...)
    axis_type: str = "explicit"
    mode: str = "eager"
    routing: str = "softmax"
    normalize_top_k: bool = True
    groups: tuple | None = None  # (n_groups, topk_groups)
    routed_scaling: float = 1.0
    num_experts: int = 4
    top_k: int = 2
    shared_experts: int = 0
    shared_expert_gate: bool = False
    capacity_factor: float | None = None
    sequence_parallel: bool = False
    zero: int = 0
    batch: int = 1  # per batch shard
    seq: int = 4  # per sequence shard
    activation: str = "swiglu"
    swiglu_limit: float = 7.0  # (of "swiglu_clamped"; small: the clamp acts on N(0, 1) rows)
    expert_bias: bool = False  # gpt-oss: router and expert biases (drawn non-zero)


def draw_case(rng: np.random.Generator) -> Case:
    """One configuration the API accepts, drawn from the whole option space."""
    sizes = dict(MESHES[rng.integers(len(MESHES))])
    ep = sizes.get("expert", 1)
    num_experts = int(ep * rng.choice([1, 2, 4]))
    num_experts = num_experts if num_experts > 1 else 2
    routing = str(rng.choice(["softmax", "sigmoid"]))
    groups = None
    if rng.random() < 0.3 and num_experts >= 4:
        n_groups = int(rng.choice([g for g in (2, 4) if num_experts % g == 0]))
        groups = (n_groups, int(rng.integers(1, n_groups + 1)))
    max_k = num_experts if groups is None else groups[1] * (num_experts // groups[0])
    top_k = int(rng.integers(1, min(max_k, 4) + 1))
    shared = int(rng.choice([0, 0, 1, 2]))
    case = Case(
        mesh=tuple((a, sizes[a]) for a in ORDER if a in sizes),
        axis_type=str(rng.choice(["explicit", "auto"])),
        mode=str(rng.choice(["eager", "jit"])),
        routing=routing,
        normalize_top_k=bool(rng.random() < 0.6),
        groups=groups,
        routed_scaling=float(rng.choice([1.0, 2.5])),
        num_experts=num_experts,
        top_k=top_k,
        shared_experts=shared,
        shared_expert_gate=bool(shared and rng.random() < 0.5),
        capacity_factor=[None, None, 0.5, 1.0, 2.0][rng.integers(5)],
        sequence_parallel=bool("model" in sizes and rng.random() < 0.5),
        zero=int(rng.choice([0, 3])) if "fsdp" in sizes else 0,
        batch=int(rng.choice([1, 2])),
    )
    # gpt-oss's options, drawn from a stream of their own (seeded by the case) so that the
    # cases drawn before them stay the same
    own = np.random.default_rng(zlib.crc32(str(case).encode()))
    clamped = bool(own.random() < 0.4)
    return dataclasses.replace(
        case,
        activation="swiglu_clamped" if clamped else "swiglu",
        swiglu_limit=float(own.choice([0.5, 7.0])) if clamped else 7.0,
        expert_bias=bool(own.random() < 0.4),
    )


def make_mesh(sizes: dict, axis_type: str = "explicit"):
    names = tuple(sizes) or ("expert",)
    shape = tuple(sizes.values()) or (1,)
    kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
    devices = jax.devices()[: math.prod(shape)]
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names), devices=devices)


def build(case: Case, *, features=8, expert_hidden=8, seed=0, **overrides):
    mesh = make_mesh(dict(case.mesh), case.axis_type)
    groups = case.groups or (None, None)
    kwargs = dict(
        num_experts=case.num_experts,
        top_k=case.top_k,
        routing=case.routing,
        normalize_top_k=case.normalize_top_k,
        n_groups=groups[0],
        topk_groups=groups[1],
        routed_scaling=case.routed_scaling,
        shared_experts=case.shared_experts,
        shared_expert_gate=case.shared_expert_gate,
        capacity_factor=case.capacity_factor,
        activation=case.activation,
        swiglu_limit=case.swiglu_limit,
        expert_bias=case.expert_bias,
        sequence_parallel=case.sequence_parallel,
        zero=case.zero,
        mesh=mesh,
        rngs=nnx.Rngs(seed),
    )
    moe = sf.layers.ParallelMoE(features, expert_hidden, **{**kwargs, **overrides})
    if moe.selection_bias is not None:  # a bias that changes the choice, not the weights
        bias = jax.random.normal(jax.random.key(seed + 7), (case.num_experts,)) * 0.3
        moe.selection_bias[...] = jax.device_put(bias, moe.selection_bias[...].sharding)
    if moe.router_bias is not None:  # non-zero biases (they are zeros at init)
        for i, name in enumerate(("router_bias", "gate_up_bias", "down_bias")):
            variable = getattr(moe, name)
            value = jax.random.normal(jax.random.key(seed + 11 + i), variable.shape) * 0.5
            variable[...] = jax.device_put(value, variable[...].sharding)
    return moe


def inputs(moe, case: Case, seed=1):
    batch_shards, sequence_shards = moe.token_groups()
    B, T = case.batch * batch_shards, case.seq * sequence_shards
    if case.sequence_parallel and moe.model_axis is not None:
        T *= 1  # case.seq is per sequence shard, divisible by the model axis (2) already
    kx, kc = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (B, T, moe.features))
    return x, jax.random.normal(kc, x.shape)


def layer_loss(model, x, ct):
    """`(loss, (y, stats))` through the NNX module: <y, ct> plus the weighted aux losses."""
    y = model(x)
    stats = moe_stats(model)
    aux = sum(c * stats[name] for name, c in AUX.items())
    stats = {k: stats[k] for k in ("load_balancing_loss", "router_z_loss", "dropped_tokens")}
    stats["tokens_per_expert"] = model.tokens_per_expert[...]
    return jnp.sum(y * ct) + aux, (y, stats)


def oracle_loss(moe):
    def loss(p, x, ct):
        y, stats = reference.moe(moe, p, x)
        aux = sum(c * stats[name] for name, c in AUX.items())
        return jnp.sum(y * ct) + aux, (y, stats)

    return loss


def check_case(case: Case, *, moe=None, x=None):
    """The layer's output, stats and every gradient (router included) equal the oracle's."""
    moe = build(case) if moe is None else moe
    if x is None:
        x, ct = inputs(moe, case)
    else:
        ct = jax.random.normal(jax.random.key(3), x.shape)
    grad = nnx.value_and_grad(layer_loss, argnums=(0, 1), has_aux=True)
    if case.mode == "jit":  # without a mesh context
        (value, (y, stats)), (g_params, g_x) = nnx.jit(grad)(moe, x, ct)
    else:  # an eager grad of Explicit-sharded values needs one (test_api.py)
        with jax.set_mesh(moe.mesh):
            (value, (y, stats)), (g_params, g_x) = grad(moe, x, ct)
    p = reference.params(moe)
    x0, ct0 = (jax.device_put(np.asarray(a), jax.devices()[0]) for a in (x, ct))
    ref_grad = jax.jit(jax.value_and_grad(oracle_loss(moe), argnums=(0, 1), has_aux=True))
    (ref_value, (ref_y, ref_stats)), (ref_g_params, ref_g_x) = ref_grad(p, x0, ct0)
    assert np.isfinite(np.asarray(ref_y)).all() and np.isfinite(np.asarray(y)).all()
    assert_sharded_as(y, moe.mesh, moe.io_spec())
    assert_close(np.asarray(y), np.asarray(ref_y), name="y")
    for name in ("load_balancing_loss", "router_z_loss"):
        assert_close(np.asarray(stats[name]), np.asarray(ref_stats[name]), name=name)
    for name in ("tokens_per_expert", "dropped_tokens"):
        np.testing.assert_array_equal(np.asarray(stats[name]), np.asarray(ref_stats[name]))
    assert_close(np.asarray(value), np.asarray(ref_value), kind="grad", atol=1e-4, name="loss")
    assert_trees_close(nnx.to_pure_dict(g_params), ref_g_params, name="grad")
    assert_close(np.asarray(g_x), np.asarray(ref_g_x), kind="grad", name="grad x")
    return stats
