"""Per-shard multi-device algorithms, called inside `jax.shard_map`."""
