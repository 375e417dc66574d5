"""Public grouped matmul entry point (`sf.grouped_matmul`); the implementations are in the registry.

`grouped_matmul` validates once, before anything is traced, puts the routing in
the backends' normal form (`base.local_groups`), then calls the requested
implementation (`implementation=` a name, a sequence of names tried in order,
or None for the platform's preference; see `kernels/registry.py`): a backend
that raises `NotImplementedError` (valid input it cannot handle: dtype,
platform) hands over to the next one.
"""

import jax.numpy as jnp

from shardfuse.kernels import registry
from shardfuse.kernels.grouped_matmul import base

_MODULE = "shardfuse.kernels.grouped_matmul."

# Backend modules are imported on first use only, so that optional
# dependencies (triton, jax_triton) are never imported by `import shardfuse`.
GROUPED_MATMUL = registry.register(
    "grouped_matmul",
    description="mixture-of-experts matmul: rows sorted by group x each group's weights, "
    "float32 accumulation, group offset for expert parallelism",
    backends=[
        registry.Backend(
            "reference",
            _MODULE + "reference",
            "reference_grouped_matmul",
            "the oracle: a loop over groups, each a masked dense product (G x the FLOPs)",
        ),
        registry.Backend(
            "xla",
            _MODULE + "xla",
            "grouped_matmul",
            "lax.ragged_dot_general forward and backward (on CPU a dense [G, M, K] expansion)",
        ),
        registry.Backend(
            "native_cpu",
            _MODULE + "native_cpu",
            "grouped_matmul",
            "C++ grouped GEMM and its transpose (XLA FFI custom calls, native/), packed "
            "micro-kernels",
            registry.native_cpu_status,
        ),
        registry.Backend(
            "pallas_tpu",
            _MODULE + "pallas_tpu",
            "grouped_matmul",
            "Pallas TPU (Mosaic) grouped GEMM and its transpose, one partial tile per group "
            "boundary",
            registry.pallas_tpu_status,
        ),
        registry.Backend(
            "triton",
            _MODULE + "triton_gpu",
            "grouped_matmul",
            "Triton grouped GEMM and its transpose through jax-triton",
            registry.triton_status,
        ),
    ],
    # What `implementation=None` tries, best first, per platform. CPU: the C++ kernels where
    # built (docs/kernels.md's table: the fastest measured), else xla.
    preference=registry.kernel_preference(cpu=("native_cpu", "xla")),
)
IMPLEMENTATIONS = GROUPED_MATMUL.names
PREFERENCE = GROUPED_MATMUL.preference  # the registry's own dict: tests patch it in place


def load_implementation(name: str):
    """Returns the backend function `name`, or raises NotImplementedError saying why not."""
    return GROUPED_MATMUL.load(name)


def grouped_matmul(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=None,
    transpose_rhs: bool = False,
    preferred_element_type=None,
    precision=None,
    implementation=None,
):
    """The mixture-of-experts matmul: each group of rows times its own weights.

        out[m] = lhs[m] @ rhs[g(m) - o]   for rows of groups o <= g(m) < o + G;  0 for the rest

    `lhs`'s rows are sorted by group: group `g` owns rows `[ends[g] - group_sizes[g],
    ends[g])` with `ends = cumsum(group_sizes)`. Products accumulate in float32
    (HIGHEST precision for float32 inputs) and are cast once.

    Expert parallelism: a shard holding experts `[o, o + G)` passes its `rhs [G, K,
    N]`, the sizes of all `G_all` groups and `group_offset=o`; it computes exactly the
    rows of groups `o` to `o + G - 1` (rows `[ends[o] - group_sizes[o], ends[o + G -
    1])`), and every other row of its output is zero, so summing the shards' outputs
    gives the unsharded result. Rows past `sum(group_sizes)` are zero too.

    The gradients are part of the op (a custom VJP on every backend but the
    reference): `d lhs = grouped_matmul(d_out, rhs^T)` (the same kernel with
    `transpose_rhs` flipped) and `d rhs[j] = lhs[rows of j]^T @ d_out[rows of j]`
    (a transposed grouped matmul; zero for empty groups). `group_sizes` and
    `group_offset` may be traced: one compilation serves every routing.

    Args:
      lhs: `[M, K]` float32, bfloat16 or float16, rows sorted by group.
      rhs: `[G, K, N]` (or `[G, N, K]` with `transpose_rhs`), lhs's dtype.
      group_sizes: `[G_all]` integer rows per group (`G_all = G` without an offset),
        concrete or traced. Concrete sizes must be >= 0 and sum to at most M;
        traced ones are used as if negative sizes were 0 and rows past M dropped.
      group_offset: None, or the first group `o` that `rhs` holds (an int or an
        integer scalar array, may be traced); concrete values must be in
        `[0, G_all - G]`, a traced one outside it computes no rows.
      transpose_rhs: rhs is laid out `[G, N, K]` (as the weights' gradient of a
        down-projection, or PyTorch's Linear) instead of `[G, K, N]`.
      preferred_element_type: the result dtype; default lhs's dtype.
      precision: None (HIGHEST for float32 inputs, DEFAULT for 16-bit), a
        `jax.lax.Precision` or its name.
      implementation: None (the platform's preference: native_cpu then xla on CPU,
        pallas_tpu on TPU, triton then xla on GPUs), one of "reference", "xla",
        "native_cpu", "pallas_tpu", "triton", or a sequence of them tried in order.

    Returns:
      `[M, N]` in `preferred_element_type`.

    Raises:
      ValueError: shapes that do not fit, negative concrete sizes or sizes summing
        to more than M, an offset past the groups, an unknown implementation.
      TypeError: non-array inputs, unsupported or mismatched dtypes, non-integer
        `group_sizes` or `group_offset`, a bad `preferred_element_type`.
      NotImplementedError: the named implementation cannot run these inputs here
        (with None or a sequence: none could, with each reason).

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> tokens = jax.random.normal(jax.random.key(0), (10, 16))   # [M, K], sorted by expert
      >>> experts = jax.random.normal(jax.random.key(1), (3, 16, 8))  # [G, K, N]
      >>> sizes = jnp.array([4, 0, 5], jnp.int32)                   # row 9 is past the sum
      >>> out = sf.grouped_matmul(tokens, experts, sizes)
      >>> out.shape, bool(jnp.allclose(out[4:9], tokens[4:9] @ experts[2], atol=1e-4))
      ((10, 8), True)
      >>> float(abs(out[9]).max())
      0.0
      >>> # expert parallelism: this shard holds experts 1 and 2 of 3
      >>> mine = sf.grouped_matmul(tokens, experts[1:], sizes, group_offset=1)
      >>> float(abs(mine[:4]).max()), bool(jnp.allclose(mine[4:], out[4:]))
      (0.0, True)
    """
    config, group_sizes, group_offset = base.validate(
        lhs,
        rhs,
        group_sizes,
        group_offset=group_offset,
        transpose_rhs=transpose_rhs,
        preferred_element_type=preferred_element_type,
        precision=precision,
    )
    GROUPED_MATMUL.candidates(implementation)  # an unknown name fails before anything runs
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    M, N = base.output_shape(lhs, rhs, config)
    if min(M, N, lhs.shape[1], rhs.shape[0]) == 0:
        # No row, column, contracted element or local group: every output is an empty sum.
        return jnp.zeros((M, N), config.out_dtype)
    sizes, start = base.local_groups(group_sizes, group_offset, rhs.shape[0], M)
    return GROUPED_MATMUL.run(
        implementation, lambda name: load_implementation(name)(config, lhs, rhs, sizes, start)
    )
