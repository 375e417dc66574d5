"""The one roofline of a ring of devices: its bandwidth, its transfers, its overlap with compute.

A ring of N devices moves data in N - 1 steps; in each step every device
sends one chunk to its neighbour. Every cost model of the package that times
a ring reads this module: the collective-matmul rings
(`collectives/collective_matmul/cost_model.py`), the ring-attention strategy
rule (`collectives/ring_attention/strategy.py`) and the planner's
communication terms (`planner/comm.py`, `planner/cost.py`).

- bandwidth: a unidirectional ring sends over one link; a bidirectional one
  sends half of each step each way, over two links, capped by everything the
  chip can send at once (its egress):
  `min(links x link, egress)`. Through a switch (NVLink, NVSwitch) the link
  equals the egress and the second direction adds nothing; on a torus (TPU
  ICI) it doubles the bandwidth.
- transfers: `(N - 1) x (step bytes / bandwidth + latency)`, the latency the
  fixed cost of one step (launch and synchronisation). A ring all-gather or
  reduce-scatter of a buffer of B bytes sends chunks of B / N; an all-reduce
  is both, twice that (Patarasuk and Yuan 2009; NCCL's `busbw`).
- overlap: when step k's compute runs while step k's transfer travels (the
  decomposed collective matmuls, ring attention), the ring takes
  `compute + (N - 1) x max(compute, transfer)` per step's compute and
  transfer, instead of `N x compute + (N - 1) x transfer` one after the other.

Peak figures, no efficiency factors: the shape of the trade-off. This module
sits at the bottom beside `hardware.py` and `flops.py` and imports nothing of
shardfuse.

Example:
  >>> from shardfuse import ring_time
  >>> bandwidth = ring_time.ring_bandwidth(100.0, 600.0, bidirectional=True)  # TPU v5p ICI
  >>> bandwidth
  200000000000.0
  >>> ring_time.ring_collective_s(4, 4e9, 1e9, 0.0)  # all-gather of 4 GB over 4 devices
  3.0
"""


def ring_bandwidth(link_gb_per_s: float, egress_gb_per_s: float, *, bidirectional: bool) -> float:
    """Bytes per second one device sends along the ring: `min(links x link, egress)`.

    Args:
      link_gb_per_s: one direction of the link to one neighbour, GB/s (1e9 B/s).
      egress_gb_per_s: everything the device can send at once, GB/s.
      bidirectional: whether the ring sends to both neighbours (two links).

    Raises:
      ValueError: a link or egress bandwidth <= 0.

    Example:
      >>> from shardfuse.ring_time import ring_bandwidth
      >>> ring_bandwidth(450.0, 450.0, bidirectional=True)  # NVLink through NVSwitch
      450000000000.0
    """
    if not (link_gb_per_s > 0 and egress_gb_per_s > 0):
        raise ValueError(
            f"link_gb_per_s={link_gb_per_s!r} and egress_gb_per_s={egress_gb_per_s!r} must be > 0"
        )
    links = 2 if bidirectional else 1
    return min(links * link_gb_per_s, egress_gb_per_s) * 1e9


def ring_transfer_s(n: int, step_bytes: float, bandwidth: float, latency: float) -> float:
    """The `n - 1` transfers of a ring of `n`: `(n - 1) x (step_bytes / bandwidth + latency)`.

    Args:
      n: devices in the ring (1: nothing moves, 0.0).
      step_bytes: bytes one device sends in one step.
      bandwidth: bytes per second (`ring_bandwidth`).
      latency: seconds, the fixed cost of one step.

    Raises:
      ValueError: a bandwidth <= 0, or a negative latency or size.

    Example:
      >>> from shardfuse.ring_time import ring_transfer_s
      >>> ring_transfer_s(4, 1e9, 1e9, 0.5), ring_transfer_s(1, 1e9, 1e9, 0.5)
      (4.5, 0.0)
    """
    if n <= 1:
        return 0.0
    if not (bandwidth > 0 and latency >= 0 and step_bytes >= 0):
        raise ValueError(
            f"bandwidth={bandwidth!r} must be > 0, latency={latency!r} and "
            f"step_bytes={step_bytes!r} >= 0"
        )
    return (n - 1) * (step_bytes / bandwidth + latency)


def ring_collective_s(
    n: int, full_bytes: float, bandwidth: float, latency: float, factor: float = 1.0
) -> float:
    """A ring all-gather or reduce-scatter of a `full_bytes` buffer over `n` devices.

    `factor` 2: an all-reduce (a reduce-scatter, then an all-gather). Each device
    sends `(n - 1) / n` of the buffer (chunks of `full_bytes / n`) and pays
    `n - 1` step latencies.

    Example:
      >>> from shardfuse.ring_time import ring_collective_s
      >>> ring_collective_s(4, 4e9, 1e9, 0.0), ring_collective_s(4, 4e9, 1e9, 0.0, factor=2.0)
      (3.0, 6.0)
    """
    return factor * ring_transfer_s(n, full_bytes / n, bandwidth, latency) if n > 1 else 0.0


def overlapped_ring_s(n: int, step_compute_s: float, step_transfer_s: float) -> float:
    """A ring whose step-k compute overlaps step-k transfer: `c + (n - 1) x max(c, t)`.

    Args:
      n: devices in the ring, as many compute steps.
      step_compute_s: compute of one step, seconds.
      step_transfer_s: one transfer, latency included, seconds (`step_bytes /
        bandwidth + latency`).

    Example:
      >>> from shardfuse.ring_time import overlapped_ring_s
      >>> overlapped_ring_s(4, 1.0, 0.5), overlapped_ring_s(4, 1.0, 2.0)  # compute-, link-bound
      (4.0, 7.0)
    """
    return step_compute_s + (n - 1) * max(step_compute_s, step_transfer_s)
