"""Single-device compute kernels: one package per op."""
