"""Flax NNX layers that wrap `jax.shard_map` around the collectives."""
