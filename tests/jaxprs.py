"""Walking jaxprs in the structure tests: the one home of `sub_jaxprs`."""

import jax
import jax.extend


def sub_jaxprs(eqn):
    """The jaxprs an equation's parameters hold (jit, shard_map, custom_vjp, cond, scan...).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> eqn = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x))(1.0).jaxpr.eqns[0]
      >>> [e.primitive.name for sub in sub_jaxprs(eqn) for e in sub.eqns]
      ['sin']
    """

    def walk(value):
        if isinstance(value, jax.extend.core.ClosedJaxpr):
            yield value.jaxpr
        elif isinstance(value, jax.extend.core.Jaxpr):
            yield value
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from walk(item)

    for value in eqn.params.values():
        yield from walk(value)
