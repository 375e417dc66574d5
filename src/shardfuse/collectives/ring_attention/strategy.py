"""Which context-parallel strategy: a roofline cost rule over ring, all_gather, Ulysses and USP.

`sf.ring_attention(..., strategy=None)` and `ring_attention_plan` predict, per
device, the forward and backward time of one attention call under each
strategy and take the fastest (ties: the order of `STRATEGIES`, ring first).
Inputs: the per-device sequence length (global / N), heads and kv heads, head
dim, dtype, and the chip's peak FLOP/s and links from `shardfuse.hardware`
(through `collective_matmul.cost_model.Hardware`). Peak numbers, no efficiency
factors: the shape of the trade-off, not a measurement.

Per device, with N devices on the sequence axis, `t_f` the forward attention
FLOPs / N at peak (causal: the visible pairs only) and `t_b = 2.5 t_f`
(FlashAttention-2 backward: five matmuls to the forward's two); `lat` the fixed
cost of one collective, the link's `latency_us` in `shardfuse.hardware` (3 µs
for NVLink and ICI):

- ring: N steps, step s computing while the next K/V shard travels to the
  neighbour over one link (`ring.py`: one direction; the overlapped ring of
  `shardfuse.ring_time`):
  `fwd = t_f/N + (N-1) max(t_f/N, kv/link + lat)`; the backward moves K/V and
  their float32 dK/dV each step: `bwd = t_b/N + (N-1) max(t_b/N, (kv + dkv)/link + 2 lat)
  + dkv/link + lat`. Memory: two K/V shards.
- all_gather: K/V gathered once, then one block, nothing overlapped:
  `fwd = gather + t_f`, `bwd = t_b + reduce-scatter(dK, dV)`, each moving
  `(N-1)/N` of the global K/V at the collective bandwidth. Memory: the whole K/V.
- ulysses (needs H % N == 0): `all_to_all` of q, k, v (kv heads repeated to
  `lcm(K, N)`), the kernel on the whole sequence for H/N heads, `all_to_all`
  of out and lse; the backward the same volume again; nothing overlapped.
- ulysses_ring (USP, Nu x Nr = N): Ulysses over Nu, then the ring over Nr
  with super-shards of `Nu L` positions and H/Nu heads.

Links: a chip whose link equals its egress sits behind a switch (NVLink
through NVSwitch): collectives run at the egress, an all-to-all sends
`(n-1)/n` of its tensor at it. Otherwise a torus (TPU ICI), the sequence axis
one ring of it (wraparound, both directions): all-gather and reduce-scatter
at `2 link`, and an all-to-all is bisection-bound: `X floor(n^2/4) / (2 n link)`
for X bytes per device. The ring's own ppermute uses one link either way.
"""

import dataclasses
import math

from shardfuse import flops, ring_time
from shardfuse import hardware as hw
from shardfuse.collectives.collective_matmul.cost_model import PRESETS, Hardware
from shardfuse.collectives.ring_attention.ulysses import kv_heads_after_expansion
from shardfuse.model_spec import get as model_spec

STRATEGIES = ("ring", "all_gather", "ulysses", "ulysses_ring")
FALLBACK_DEVICE = "h100-sxm"  # the figures strategy=None uses where the chip is unknown (CPU)
BACKWARD_FLOPS_RATIO = flops.BACKWARD_OVER_FORWARD
LSE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class StrategyCost:
    """The predicted cost of one strategy, per device (seconds, bytes).

    Attributes:
      strategy: "ring", "all_gather", "ulysses" or "ulysses_ring".
      ulysses_size: devices of the Ulysses all-to-all (1 for ring and all_gather).
      ring_size: devices of the ring (1 for ulysses; for all_gather, the gather).
      forward_s, backward_s: predicted times.
      bytes_sent: bytes this device sends, forward + backward.
      kv_bytes: K/V bytes held at once (memory the strategy needs beyond its shards).
      applicable: whether this strategy can run these inputs on this mesh.
      why_not: the reason, when not applicable.

    Example usage::

      >>> from shardfuse.collectives.ring_attention.strategy import StrategyCost
      >>> StrategyCost("ring", 1, 8, forward_s=1e-3, backward_s=2e-3, bytes_sent=0.0,
      ...              kv_bytes=0.0).total_s
      0.003
    """

    strategy: str
    ulysses_size: int
    ring_size: int
    forward_s: float
    backward_s: float
    bytes_sent: float
    kv_bytes: float
    applicable: bool = True
    why_not: str = ""

    @property
    def total_s(self) -> float:
        """forward + backward."""
        return self.forward_s + self.backward_s


def resolve_hardware(hardware=None, dtype: str = "bfloat16") -> Hardware:
    """A cost-model `Hardware` from None (this chip, or H100 SXM where unknown), a
    `shardfuse.hardware` key or `Device`, a cost-model preset name, or a `Hardware`.

    From `shardfuse.hardware` the `step_latency_us` is the link's `latency_us`; a
    `Hardware` or a preset keeps its own.

    Raises:
      ValueError: an unknown name, or a chip without link figures.

    Example usage::

      >>> from shardfuse.collectives.ring_attention.strategy import resolve_hardware
      >>> resolve_hardware("tpu-v5p").link_gb_per_s
      100.0
    """
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware in PRESETS:
        return PRESETS[hardware]
    if hardware is None:
        hardware = hw.current_device()
        if hardware is None or hardware.link is None:
            hardware = FALLBACK_DEVICE
    device = hw.device(hardware) if isinstance(hardware, str) else hardware
    if not isinstance(device, hw.Device):
        raise ValueError(
            f"hardware={hardware!r} must be None, a key of shardfuse.hardware "
            f"{hw.names()}, one of {sorted(PRESETS)} or a cost_model.Hardware"
        )
    peak_dtype = dtype if device.peak_tflops(dtype) is not None else "bfloat16"
    figures = Hardware.from_device(device, peak_dtype)
    return dataclasses.replace(figures, step_latency_us=device.link.latency_us)


def _all_to_all_s(nbytes, n, hardware, latency):
    if n == 1:
        return 0.0
    link, egress = hardware.link_gb_per_s * 1e9, hardware.egress_gb_per_s * 1e9
    if link >= egress:  # switch: every peer at the egress rate
        return nbytes * (n - 1) / n / egress + latency
    return nbytes * (n * n // 4) / (2 * n * link) + latency  # torus ring: bisection-bound


def _ring_s(t_f, kv, dkv, n, hardware, latency):
    link = hardware.ring_bandwidth(bidirectional=False)  # ring.py sends one direction
    step_f, step_b = t_f / n, BACKWARD_FLOPS_RATIO * t_f / n
    if n == 1:
        return step_f, step_b, 0.0
    forward = ring_time.overlapped_ring_s(n, step_f, kv / link + latency)
    backward = ring_time.overlapped_ring_s(n, step_b, (kv + dkv) / link + 2 * latency)
    backward += dkv / link + latency  # the accumulators' last hop home
    return forward, backward, (n - 1) * (2 * kv + dkv) + dkv


def strategy_costs(
    *,
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    sequence_size: int,
    kv_seq_len: int | None = None,
    ulysses_size: int | None = None,
    dtype_bytes: int = 2,
    causal: bool = True,
    hardware=None,
    latency_us: float | None = None,
) -> tuple:
    """Predicted per-device costs of every strategy for one attention call (sizes per
    data / model shard: `heads` and `kv_heads` are those on one device before context parallelism).

    Args:
      batch: B on one device.
      seq_len: global query length T; `kv_seq_len`: S (default T).
      heads, kv_heads, head_dim: H, K, D on one device.
      sequence_size: N, devices on the sequence axis (or axes).
      ulysses_size: for ulysses_ring, the Ulysses degree Nu (a divisor of N; the ring
        runs over N / Nu); None: ulysses_ring is not considered.
      dtype_bytes: bytes per element of q, k, v (2: bfloat16).
      causal: only the causal pairs are computed.
      hardware: as `resolve_hardware`.
      latency_us: fixed cost of one collective, µs; None: the hardware's `step_latency_us`.

    Returns:
      A tuple of `StrategyCost`: ring, all_gather, ulysses, then ulysses_ring if asked.

    Raises:
      ValueError: sizes that are not positive ints, or a `ulysses_size` not dividing N.

    Example usage::

      >>> from shardfuse.collectives.ring_attention import strategy
      >>> costs = strategy.strategy_costs(batch=1, seq_len=131072, heads=32, kv_heads=8,
      ...     head_dim=128, sequence_size=8, hardware="h100-sxm")
      >>> [c.strategy for c in costs]
      ['ring', 'all_gather', 'ulysses']
    """
    kv_seq_len = seq_len if kv_seq_len is None else kv_seq_len
    sizes = dict(batch=batch, seq_len=seq_len, kv_seq_len=kv_seq_len, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, sequence_size=sequence_size,
                 dtype_bytes=dtype_bytes)  # fmt: skip
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    n = sequence_size
    if ulysses_size is not None and (
        isinstance(ulysses_size, bool)
        or not isinstance(ulysses_size, int)
        or ulysses_size < 1
        or n % ulysses_size
    ):
        raise ValueError(f"ulysses_size={ulysses_size!r} must be a divisor of sequence_size={n}")
    hardware = resolve_hardware(hardware)
    if latency_us is None:
        latency_us = hardware.step_latency_us
    latency = _check_latency(latency_us) * 1e-6
    B, T, S, H, K, D, e = batch, seq_len, kv_seq_len, heads, kv_heads, head_dim, dtype_bytes
    t_f = flops.attention_flops(B, T, S, H, D, causal=causal) / n / (hardware.tflops * 1e12)
    t_b = BACKWARD_FLOPS_RATIO * t_f
    costs = []

    kv = 2 * B * (S / n) * K * D * e  # this device's K and V
    forward, backward, sent = _ring_s(t_f, kv, kv * 4 / e, n, hardware, latency)  # dK/dV: f32
    costs.append(StrategyCost("ring", 1, n, forward, backward, sent, 2 * kv))

    # a collective over the whole axis: both directions of a torus ring, the egress of a switch
    bandwidth = hardware.ring_bandwidth(bidirectional=True)
    gather = (n - 1) * kv / bandwidth + 2 * latency if n > 1 else 0.0
    costs.append(
        StrategyCost("all_gather", 1, n, gather + t_f, t_b + gather, 2 * (n - 1) * kv, n * kv)
    )

    def ulysses(name, nu, nr):
        k_expanded = kv_heads_after_expansion(K, nu)
        q_bytes, lse_bytes = B * (T / n) * H * D * e, B * (T / n) * H * LSE_BYTES
        kv_bytes = 2 * B * (S / n) * k_expanded * D * e
        a2a = [_all_to_all_s(x, nu, hardware, latency) for x in (q_bytes, kv_bytes / 2, lse_bytes)]
        exchange = 2 * a2a[0] + 2 * a2a[1] + a2a[2]  # q, k, v in; out, lse back
        volume = (2 * q_bytes + kv_bytes + lse_bytes) * (nu - 1) / nu
        ring_kv = 2 * B * (S / nr) * (k_expanded / nu) * D * e
        ring_f, ring_b, ring_sent = _ring_s(t_f, ring_kv, ring_kv * 4 / e, nr, hardware, latency)
        why = "" if H % nu == 0 else f"heads per device H={H} is not a multiple of {nu}"
        held = 2 * ring_kv if nr > 1 else B * S * k_expanded / nu * 2 * D * e
        return StrategyCost(
            name, nu, nr, exchange + ring_f, exchange + ring_b, 2 * volume + ring_sent, held,
            applicable=not why, why_not=why,
        )  # fmt: skip

    costs.append(ulysses("ulysses", n, 1))
    if ulysses_size is not None:
        costs.append(ulysses("ulysses_ring", ulysses_size, n // ulysses_size))
    return tuple(costs)


def choose(costs, allowed=STRATEGIES) -> str:
    """The rule: the applicable strategy in `allowed` with the smallest forward + backward time.

    Raises:
      ValueError: no strategy in `allowed` is applicable (the reasons are listed).

    Example usage::

      >>> from shardfuse.collectives.ring_attention import strategy
      >>> costs = strategy.strategy_costs(batch=1, seq_len=1 << 20, heads=32, kv_heads=8,
      ...     head_dim=128, sequence_size=8, hardware="tpu-v5p")
      >>> strategy.choose(costs)
      'ring'
    """
    usable = [c for c in costs if c.applicable and c.strategy in allowed]
    if not usable:
        reasons = "; ".join(f"{c.strategy}: {c.why_not}" for c in costs if c.strategy in allowed)
        raise ValueError(f"no context-parallel strategy applies: {reasons}")
    order = {name: i for i, name in enumerate(STRATEGIES)}
    return min(usable, key=lambda c: (c.total_s, order[c.strategy])).strategy


def predicted_winners(
    model, *, hardware, seq_lens, sequence_size: int = 8, ulysses_size: int | None = None,
    batch: int = 1, causal: bool = True,
) -> list[dict]:  # fmt: skip
    """One row per sequence length: each strategy's predicted forward + backward ms and the winner.

    `model`: a `shardfuse.models.ModelSpec` (heads, kv heads, head dim); bfloat16.

    Example usage::

      >>> from shardfuse import models
      >>> from shardfuse.collectives.ring_attention import strategy
      >>> rows = strategy.predicted_winners(models.get("llama3-8b"), hardware="tpu-v5p",
      ...     seq_lens=(8192, 1 << 20))
      >>> [row["seq_len"] for row in rows]
      [8192, 1048576]
    """
    rows = []
    for seq_len in seq_lens:
        costs = strategy_costs(
            batch=batch, seq_len=seq_len, heads=model.heads, kv_heads=model.kv_heads,
            head_dim=model.head_dim, sequence_size=sequence_size, ulysses_size=ulysses_size,
            causal=causal, hardware=hardware,
        )  # fmt: skip
        row = {"seq_len": seq_len, "winner": choose(costs)}
        row.update({c.strategy: round(c.total_s * 1e3, 4) for c in costs})
        rows.append(row)
    return rows


def crossovers(rows) -> list[tuple[int, str, str]]:
    """`(seq_len, old winner, new winner)` wherever the winner changes along the rows of
    `predicted_winners`.

    Example usage::

      >>> from shardfuse import models
      >>> from shardfuse.collectives.ring_attention import strategy
      >>> rows = strategy.predicted_winners(models.get("llama3-8b"), hardware="h100-sxm",
      ...     seq_lens=[8192, 16384])
      >>> strategy.crossovers(rows)
      [(16384, 'ulysses', 'ring')]
    """
    return [
        (b["seq_len"], a["winner"], b["winner"])
        for a, b in zip(rows, rows[1:], strict=False)
        if a["winner"] != b["winner"]
    ]


def _check_latency(latency_us) -> float:
    """`latency_us` if it is a finite number >= 0, else ValueError."""
    if isinstance(latency_us, bool) or not isinstance(latency_us, int | float):
        raise ValueError(f"latency_us={latency_us!r} must be a number >= 0")
    if not (math.isfinite(latency_us) and latency_us >= 0):
        raise ValueError(f"latency_us={latency_us!r} must be a finite number >= 0")
    return float(latency_us)


def main() -> None:
    """Prints the predicted winners for llama3-8b, 8k to 1M tokens, on H100 SXM and TPU v5p
    (8 devices; USP as 4 x 2):
    `python -c "from shardfuse.collectives.ring_attention import strategy; strategy.main()"`."""
    lens = [8192 << i for i in range(8)]
    for hardware in ("h100-sxm", "tpu-v5p"):
        rows = predicted_winners(
            model_spec("llama3-8b"),
            hardware=hardware,
            seq_lens=lens,
            sequence_size=8,
            ulysses_size=4,
        )
        print(f"llama3-8b on {resolve_hardware(hardware).name}, 8 devices, fwd + bwd ms:")
        print(f"{'T':>8} {'winner':12} " + " ".join(f"{s:>12}" for s in STRATEGIES))
        for row in rows:
            times = " ".join(f"{row[s]:12.3f}" for s in STRATEGIES)
            print(f"{row['seq_len']:>8} {row['winner']:12} {times}")
        print(f"crossovers: {crossovers(rows)}\n")


if __name__ == "__main__":
    main()
