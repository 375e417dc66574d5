"""A roofline cost model of the decomposed collective-matmul rings.

For a ring of N devices, every device runs N matmul steps and N - 1 transfer
steps; transfer k overlaps matmul k (the ring schedules of `ring.py`), so

    serial     = N * t_compute + (N - 1) * t_transfer      (collective, then matmul)
    overlapped = t_compute + (N - 1) * max(t_compute, t_transfer)
    hidden     = (serial - overlapped) / ((N - 1) * t_transfer)   in [0, 1]

with `t_compute = step FLOPs / peak FLOP/s` and `t_transfer = step bytes / link
bandwidth (+ latency)`: the ring roofline of `shardfuse.ring_time`. `hidden` is
the predicted overlap efficiency: the fraction of the communication time that
the matmuls hide (1 when every step is compute-bound). A bidirectional ring
sends half of each step's bytes each way, which doubles the bandwidth where the
two directions use separate links (TPU ICI torus) and changes nothing where
they share one egress (NVLink through NVSwitch). Peak numbers, no efficiency
factors: the prediction is an upper bound on overlap, the shape of the
trade-off rather than a measurement.

Bytes follow the implementation: an all-gather ring moves x in its dtype, so
each device sends `(N - 1) / N` of the gathered x; a reduce-scatter ring moves
float32 partial sums, `(N - 1) / N` of the full float32 product. Shapes are
global (the unsharded layer): x `[M, C]`, w `[C, F]`.

Hardware presets take their figures from `shardfuse.hardware` (sources cited
there): "h100_nvlink" is an H100 SXM (989 dense bf16 TFLOP/s, NVLink 4 at
450 GB/s each way through NVSwitch), "tpu_v5p_ici" a TPU v5p (459 bf16 TFLOP/s,
ICI 100 GB/s per link each way, 6 links); `Hardware.from_device` builds one
for any chip of that table whose link figures are known.
"""

import dataclasses
import math

from shardfuse import ring_time
from shardfuse.flops import matmul_flops
from shardfuse.hardware import Device
from shardfuse.hardware import device as hardware_device
from shardfuse.model_spec import ModelSpec
from shardfuse.model_spec import get as model_spec

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
PARTIAL_SUM_BYTES = 4  # partial sums travel in float32


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Peak numbers of one device and its ring links.

    Attributes:
      name: label for reports.
      tflops: matmul peak in TFLOP/s (1e12 FLOP/s) for the dtype of interest.
      link_gb_per_s: one direction of the link to one ring neighbour, GB/s (1e9 B/s).
      egress_gb_per_s: everything a device can send at once, GB/s (caps a
        bidirectional ring that sends to two neighbours).
      step_latency_us: fixed cost of one ring transfer (launch, synchronisation), µs.
    """

    name: str
    tflops: float
    link_gb_per_s: float
    egress_gb_per_s: float
    step_latency_us: float = 0.0

    def __post_init__(self):
        for field in ("tflops", "link_gb_per_s", "egress_gb_per_s"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Hardware.{field}={value!r} must be a finite number > 0")
        if not (math.isfinite(self.step_latency_us) and self.step_latency_us >= 0):
            raise ValueError(f"Hardware.step_latency_us={self.step_latency_us!r} must be >= 0")

    @classmethod
    def from_device(cls, device: "Device | str", dtype: str = "bfloat16") -> "Hardware":
        """The peak of `device` for `dtype` and its link, from `shardfuse.hardware`.

        Args:
          device: a `shardfuse.hardware.Device` or its key ("h100-sxm", "tpu-v5p").
          dtype: the matmul dtype whose peak is used.

        Raises:
          ValueError: unknown device, or one without a `dtype` peak or link figures.

        Example:
          >>> from shardfuse.collectives.collective_matmul.cost_model import Hardware
          >>> Hardware.from_device("tpu-v5p").link_gb_per_s
          100.0
        """
        if isinstance(device, str):
            device = hardware_device(device)
        tflops = device.peak_tflops(dtype)
        if tflops is None or device.link is None:
            missing = f"{dtype} peak" if tflops is None else "link figures"
            raise ValueError(f"device {device.key!r} has no {missing} in shardfuse.hardware")
        return cls(
            f"{device.name}, {device.link.name}",
            tflops,
            device.link.gb_per_s,
            device.link.egress_gb_per_s,
        )

    def ring_bandwidth(self, bidirectional: bool) -> float:
        """Bytes per second one device sends along the ring (`ring_time.ring_bandwidth`).

        Example:
          >>> from shardfuse.collectives.collective_matmul.cost_model import PRESETS
          >>> PRESETS["tpu_v5p_ici"].ring_bandwidth(bidirectional=True)
          200000000000.0
        """
        return ring_time.ring_bandwidth(
            self.link_gb_per_s, self.egress_gb_per_s, bidirectional=bidirectional
        )


PRESETS = {
    "h100_nvlink": Hardware.from_device("h100-sxm"),
    "tpu_v5p_ici": Hardware.from_device("tpu-v5p"),
}


@dataclasses.dataclass(frozen=True)
class RingCost:
    """The predicted cost of one collective matmul on one device (seconds, bytes, FLOPs)."""

    op: str
    ring_size: int
    bidirectional: bool
    flops_per_step: float
    bytes_per_step: float
    bytes_sent: float  # by this device, over the whole op
    compute_s: float  # N steps of matmul
    transfer_s: float  # N - 1 transfers (plus, for all-reduce, the result all-gather)
    serial_s: float  # collective and matmul one after the other
    overlapped_s: float  # the ring
    hidden_fraction: float  # predicted overlap efficiency

    @property
    def speedup(self) -> float:
        """serial / overlapped."""
        return self.serial_s / self.overlapped_s if self.overlapped_s else 1.0


def _check(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def ring_cost(
    op: str,
    *,
    rows: int,
    contract: int,
    cols: int,
    ring_size: int,
    hardware: Hardware | str,
    dtype_bytes: int = 2,
    bidirectional: bool = False,
) -> RingCost:
    """Bytes, FLOPs and predicted time of a collective matmul for global x `[M, C]` @ w `[C, F]`.

    all_gather_matmul: x sharded on M, w on F; each device multiplies every
    M/N-row chunk of x by its `[C, F/N]` columns. matmul_reduce_scatter and
    matmul_all_reduce: x and w sharded on C; each device multiplies an `[M/N, C/N]`
    chunk by `[C/N, F]` per step. all_reduce adds an all-gather of its
    `[M/N, F]` result that nothing overlaps.

    Args:
      op: "all_gather_matmul", "matmul_reduce_scatter" or "matmul_all_reduce".
      rows: M (tokens: batch x sequence).
      contract: C.
      cols: F.
      ring_size: N.
      hardware: a `Hardware` or a key of `PRESETS`.
      dtype_bytes: bytes per element of x and of the result (2 for bfloat16).
      bidirectional: half of each step each way.

    Returns:
      A `RingCost`.

    Raises:
      ValueError: unknown op or preset, or sizes that are not positive ints.

    Example:
      >>> from shardfuse.collectives.collective_matmul import cost_model
      >>> cost = cost_model.ring_cost("all_gather_matmul", rows=8192, contract=4096,
      ...     cols=14336, ring_size=8, hardware="h100_nvlink")
      >>> cost.bytes_sent == 7 / 8 * 8192 * 4096 * 2
      True
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {OPS}")
    if isinstance(hardware, str):
        if hardware not in PRESETS:
            raise ValueError(f"hardware={hardware!r} is not one of {sorted(PRESETS)}")
        hardware = PRESETS[hardware]
    for name, value in (
        ("rows", rows),
        ("contract", contract),
        ("cols", cols),
        ("ring_size", ring_size),
        ("dtype_bytes", dtype_bytes),
    ):
        _check(name, value)
    n = ring_size
    if op == "all_gather_matmul":
        flops_per_step = matmul_flops(rows / n, cols / n, contract)
        bytes_per_step = (rows / n) * contract * dtype_bytes  # one chunk of x
    else:
        flops_per_step = matmul_flops(rows / n, cols, contract / n)
        bytes_per_step = (rows / n) * cols * PARTIAL_SUM_BYTES  # one float32 partial sum
    bandwidth = hardware.ring_bandwidth(bidirectional and n > 1)
    latency = hardware.step_latency_us * 1e-6
    t_compute = flops_per_step / (hardware.tflops * 1e12)
    t_transfer = bytes_per_step / bandwidth + latency
    steps = n - 1
    compute_s = n * t_compute
    ring_transfer_s = ring_time.ring_transfer_s(n, bytes_per_step, bandwidth, latency)
    serial_s = compute_s + ring_transfer_s
    overlapped_s = ring_time.overlapped_ring_s(n, t_compute, t_transfer)
    hidden = (serial_s - overlapped_s) / ring_transfer_s if ring_transfer_s else 1.0
    bytes_sent = steps * bytes_per_step
    transfer_s = ring_transfer_s
    if op == "matmul_all_reduce":  # then all-gather the reduced [M/N, F] chunks
        gather_bytes = (rows / n) * cols * dtype_bytes
        gather_s = ring_time.ring_transfer_s(n, gather_bytes, bandwidth, latency)
        bytes_sent += steps * gather_bytes
        transfer_s += gather_s
        serial_s += gather_s
        overlapped_s += gather_s
    return RingCost(
        op=op,
        ring_size=n,
        bidirectional=bidirectional,
        flops_per_step=flops_per_step,
        bytes_per_step=bytes_per_step,
        bytes_sent=bytes_sent,
        compute_s=compute_s,
        transfer_s=transfer_s,
        serial_s=serial_s,
        overlapped_s=overlapped_s,
        hidden_fraction=hidden,
    )


def layer_costs(
    model: ModelSpec | str, *, tokens: int, ring_size: int, hardware: Hardware | str, **kwargs
):
    """Costs of a Megatron sequence-parallel MLP of `model` (a `shardfuse.models.ModelSpec`
    or its name).

    Returns `{"mlp_up (all_gather_matmul)": RingCost, "mlp_down (matmul_reduce_scatter)": ...}`
    for x `[tokens, hidden]` @ `[hidden, ffn_hidden]` and back.

    Example:
      >>> from shardfuse.collectives.collective_matmul import cost_model
      >>> costs = cost_model.layer_costs("llama3-8b", tokens=8192, ring_size=8,
      ...     hardware="tpu_v5p_ici", bidirectional=True)
      >>> sorted(costs)
      ['mlp_down (matmul_reduce_scatter)', 'mlp_up (all_gather_matmul)']
    """
    if isinstance(model, str):
        model = model_spec(model)
    up = ring_cost(
        "all_gather_matmul",
        rows=tokens,
        contract=model.hidden,
        cols=model.ffn_hidden,
        ring_size=ring_size,
        hardware=hardware,
        **kwargs,
    )
    down = ring_cost(
        "matmul_reduce_scatter",
        rows=tokens,
        contract=model.ffn_hidden,
        cols=model.hidden,
        ring_size=ring_size,
        hardware=hardware,
        **kwargs,
    )
    return {"mlp_up (all_gather_matmul)": up, "mlp_down (matmul_reduce_scatter)": down}


def prediction_rows(
    models=("llama3-8b", "llama3-70b"), *, tokens: int = 16384, ring_size: int = 8
) -> list[dict]:
    """Predicted overlap of the sequence-parallel MLP of each model on every preset.

    One row per (model, preset, direction, projection): hidden fraction,
    overlapped and serial microseconds, speedup. Used by the bench notes.

    Example:
      >>> from shardfuse.collectives.collective_matmul import cost_model
      >>> rows = cost_model.prediction_rows(("llama3-70b",))
      >>> {row["hidden"] for row in rows if row["preset"] == "h100_nvlink"} <= {1.0, 0.815}
      True
    """
    rows = []
    for name in models:
        for preset in PRESETS:
            for bidirectional in (False, True):
                costs = layer_costs(
                    name,
                    tokens=tokens,
                    ring_size=ring_size,
                    hardware=preset,
                    bidirectional=bidirectional,
                )
                for projection, cost in costs.items():
                    rows.append(
                        dict(
                            model=name,
                            preset=preset,
                            ring="bidirectional" if bidirectional else "unidirectional",
                            projection=projection,
                            hidden=round(cost.hidden_fraction, 3),
                            overlapped_us=cost.overlapped_s * 1e6,
                            serial_us=cost.serial_s * 1e6,
                            speedup=cost.speedup,
                        )
                    )
    return rows


def main() -> None:
    """Prints `prediction_rows()` (run this module with `python -m`)."""
    print(f"{'model':11} {'hardware':12} {'ring':15} {'projection':33} hidden  ring/serial us")
    for row in prediction_rows():
        print(
            f"{row['model']:11} {row['preset']:12} {row['ring']:15} {row['projection']:33} "
            f"{row['hidden']:6.0%}  {row['overlapped_us']:.0f} / {row['serial_us']:.0f}"
        )


if __name__ == "__main__":
    main()
