"""Random parameters that are generated straight into their output buffer.

JAX's default PRNG (threefry2x32, `jax_threefry_partitionable`) gives each
element of a random array the bits `threefry2x32(key, flat index)`, so the
values depend on the key only, not on how the array is split over devices.
On CPU, JAX lowers the threefry hash as a rolled loop (`lax.fori_loop` over
its 5 round groups) whose carry holds both 32-bit words of every element:
that loop cannot fuse with the initializer's arithmetic, and an initializer
(a truncated normal: bits, uniform, `erf_inv`, scale) then needs about 5x a
parameter's bytes of temporaries while it runs (measured on the tiny LM: a
compiled `sf.parallel.init` peaked at 2.6x the sharded state).

`fused_key(key)` rewraps a threefry key as a key of `FUSED_THREEFRY`, an
implementation with the same key data, `split` and `fold_in` and the SAME
random bits, computed by the unrolled hash from broadcasted iotas: one
elementwise expression from the flat index to the initializer's output,
which XLA fuses into a single loop writing each device's shard in place.
The bits are bitwise those of the threefry key, and so the values are on
every mesh and on one device (`tests/parallel/test_init.py`); against the
unfused threefry program, values that go through `erf_inv` (a truncated
normal) may differ in the last place or two where XLA compiles `erf_inv`
differently inside the fused loop (jax 0.12 does, jax 0.10 does not).

Arrays of 2**32 elements or more, and `jax_threefry_partitionable=False`,
take threefry's own bits (same values, the unfused program).
"""

import math

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
from jax import lax

_THREEFRY = jex_random.threefry_prng_impl
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _rotate_left(x, distance: int):
    return lax.shift_left(x, np.uint32(distance)) | lax.shift_right_logical(
        x, np.uint32(32 - distance)
    )


def threefry2x32(key1, key2, x1, x2):
    """The Threefry-2x32 hash (20 rounds) of the word pairs `(x1, x2)`, unrolled.

    The same function as `jax.extend.random.threefry2x32_p`, written in
    elementwise ops so that it fuses with its producers and consumers.

    Example usage::

      >>> import jax, numpy as np
      >>> from jax.extend.random import threefry_2x32
      >>> from shardfuse.layers._init_random import threefry2x32
      >>> k, x = np.uint32([1, 2]), np.uint32([3, 4])
      >>> ours = np.concatenate(threefry2x32(k[0], k[1], x[:1], x[1:]))
      >>> bool((ours == threefry_2x32(k, x)).all())
      True
    """
    ks = (key1, key2, key1 ^ key2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for group in range(5):
        for rotation in _ROTATIONS[group % 2]:
            x1 = x1 + x2
            x2 = _rotate_left(x2, rotation) ^ x1
        x1 = x1 + ks[(group + 1) % 3]
        x2 = x2 + ks[(group + 2) % 3] + np.uint32(group + 1)
    return x1, x2


def _flat_index(shape):
    """uint32 `shape`: each element's row-major flat index (shape smaller than 2**32)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
        stride *= shape[dim]
    return index


def _random_bits(key, bit_width: int, shape):
    """`bit_width` random bits of `shape`: the partitionable threefry bits, fused."""
    if not jax.config.jax_threefry_partitionable or math.prod(shape) >= 2**32:
        return _THREEFRY.random_bits(key, bit_width, shape)
    # the flat index as two words (high word 0 below 2**32 elements), as JAX's iota_2x32_shape
    bits1, bits2 = threefry2x32(key[0], key[1], jnp.zeros(shape, jnp.uint32), _flat_index(shape))
    dtype = _UINT[bit_width]
    if bit_width == 64:
        return lax.shift_left(bits1.astype(dtype), dtype(32)) | bits2.astype(dtype)
    bits = bits1 ^ bits2
    return bits if bit_width == 32 else bits.astype(dtype)


FUSED_THREEFRY = jex_random.define_prng_impl(
    key_shape=(2,),
    seed=_THREEFRY.seed,
    split=_THREEFRY.split,
    random_bits=_random_bits,
    fold_in=_THREEFRY.fold_in,
    name="threefry2x32_fused",
    tag="fryf",
)


def fused_key(key):
    """`key` as a `FUSED_THREEFRY` key: the same random values, a fusable program.

    A typed threefry key (`jax.random.key`) or a raw one (uint32 `[..., 2]`,
    `jax.random.PRNGKey`) is rewrapped; keys of other implementations (and
    `FUSED_THREEFRY` keys) are returned as they are.

    Example usage::

      >>> import jax, numpy as np
      >>> from shardfuse.layers._init_random import fused_key
      >>> key = jax.random.key(0)
      >>> fused = jax.jit(lambda k: jax.random.normal(fused_key(k), (4, 3)))(key)
      >>> bool((np.asarray(fused) == np.asarray(jax.random.normal(key, (4, 3)))).all())
      True
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if jax.random.key_impl(key) != "threefry2x32":
            return key
        key = jax.random.key_data(key)
    elif key.dtype != jnp.uint32 or key.shape[-1:] != (2,):
        return key  # not a threefry key: the initializer reports it
    return jax.random.wrap_key_data(key, impl=FUSED_THREEFRY)
