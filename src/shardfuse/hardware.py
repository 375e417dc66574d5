"""Accelerator figures: peak FLOP/s per dtype, HBM size and bandwidth, interconnect links.

One home for hardware numbers, read by the benchmarks ("% of peak"), the
collective-matmul cost model and, later, the planner. This module sits at the
bottom of the package: it imports nothing from shardfuse (jax only inside
`current_device`), and everything else may import it.

Conventions: per chip (one GPU, one TPU chip); vendors' *dense* peaks (no 2:4
sparsity); TFLOP/s = 1e12 FLOP/s; GB = 1e9 bytes. `float32` is the GPU's
non-tensor-core FP32 peak, the rate `Precision.HIGHEST` float32 matmuls get;
TPUs publish no float32 peak (None). A link figure is one direction of one
link to one neighbour; `egress_gb_per_s` is everything a chip can send at once
(one direction, all links together).

Sources (vendor datasheets and product pages):
  H100 SXM / NVL / PCIe: https://www.nvidia.com/en-us/data-center/h100/ and the
    "NVIDIA H100 Tensor Core GPU" datasheet: BF16/FP16 1,979 (SXM), 1,671 (NVL),
    1,513 (PCIe) TFLOP/s *with sparsity*, so dense = half; FP32 67 / 60 / 51;
    HBM 80 GB 3.35 TB/s (SXM), 94 GB 3.9 TB/s (NVL), 80 GB 2.0 TB/s (PCIe);
    NVLink 900 GB/s (SXM, NVLink 4 through NVSwitch), 600 GB/s (NVL and PCIe,
    NVLink bridge), both directions together.
  H200 SXM / NVL: https://www.nvidia.com/en-us/data-center/h200/ : the tensor
    compute of H100 (BF16 1,979 sparse -> 989 dense on SXM), 141 GB HBM3e at
    4.8 TB/s, NVLink 900 GB/s.
  A100: https://www.nvidia.com/en-us/data-center/a100/ : BF16 312 dense,
    FP32 19.5; HBM 80 GB at 2,039 GB/s (SXM) or 1,935 GB/s (PCIe), 40 GB at
    1,555 GB/s; NVLink 3 600 GB/s both directions together.
  TPU v4:  https://cloud.google.com/tpu/docs/v4  : 275 bf16 TFLOP/s, 32 GiB HBM2 at 1,200 GB/s.
  TPU v5e: https://cloud.google.com/tpu/docs/v5e : 197 bf16 TFLOP/s, 16 GB HBM2 at 819 GB/s,
    ICI 400 GB/s bidirectional per chip over 4 ports (2D torus).
  TPU v5p: https://cloud.google.com/tpu/docs/v5p : 459 bf16 TFLOP/s, 95 GB HBM2e at 2,765 GB/s,
    ICI 1,200 GB/s bidirectional per chip over 6 links (3D torus).
  TPU v6e: https://cloud.google.com/tpu/docs/v6e : 918 bf16 TFLOP/s, 32 GB HBM at 1,640 GB/s.
  (The ICI figures of v4 and v6e are not filled in yet: `link` is None there.)

CPUs have no entry: their "% of peak" is "n/a".

Example:
  >>> from shardfuse import hardware
  >>> hardware.device("h100-sxm").peak_tflops("bfloat16")
  989.4
  >>> hardware.detect("NVIDIA H100 80GB HBM3").name
  'H100 SXM'
  >>> hardware.detect("cpu") is None
  True
"""

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Link:
    """A chip's interconnect to its neighbours, one direction.

    Attributes:
      name: "NVLink 4", "ICI".
      gb_per_s: one direction of the link to one neighbour, GB/s.
      egress_gb_per_s: everything the chip can send at once (all links, one
        direction), GB/s: caps a bidirectional ring that sends to two neighbours.
        Through an NVSwitch every peer shares the same egress, so it equals `gb_per_s`.
    """

    name: str
    gb_per_s: float
    egress_gb_per_s: float

    def __post_init__(self):
        for field in ("gb_per_s", "egress_gb_per_s"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"Link.{field}={value!r} must be a number > 0")


@dataclasses.dataclass(frozen=True)
class Device:
    """Figures of one accelerator chip.

    Attributes:
      key: the name `device()` takes ("h100-sxm", "tpu-v5p").
      name: the name reports print ("H100 SXM", "TPU v5p").
      tflops: dense peak TFLOP/s per dtype name ("bfloat16", "float16",
        "float32"); a missing dtype or None means no published peak.
      hbm_gb: HBM capacity, GB (1e9 bytes).
      hbm_gb_per_s: HBM bandwidth, GB/s.
      link: its interconnect, or None where not filled in.
      kind_pattern: a regular expression on the lower-cased
        `jax.Device.device_kind` that names this chip.
    """

    key: str
    name: str
    tflops: dict[str, float | None]
    hbm_gb: float
    hbm_gb_per_s: float
    link: Link | None
    kind_pattern: str

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for `dtype` (a name or a numpy/jax dtype), None when unpublished.

        Example:
          >>> from shardfuse import hardware
          >>> hardware.device("tpu-v5e").peak_tflops("float32") is None
          True
        """
        return self.tflops.get(str(dtype))


def _gpu(key, name, bf16, fp32, hbm_gb, hbm_gb_per_s, nvlink_both_ways, pattern, version):
    # NVLink figures are both directions together: one direction is half. Through an
    # NVSwitch (or a bridge) a GPU's egress is shared by all its peers.
    one_way = nvlink_both_ways / 2
    link = Link(f"NVLink {version}", one_way, one_way)
    flops = {"bfloat16": bf16, "float16": bf16, "float32": fp32}
    return Device(key, name, flops, hbm_gb, hbm_gb_per_s, link, pattern)


def _tpu(key, name, bf16, hbm_gb, hbm_gb_per_s, pattern, ici_both_ways=None, ici_links=None):
    link = None
    if ici_both_ways is not None:
        egress = ici_both_ways / 2
        link = Link("ICI", egress / ici_links, egress)
    return Device(
        key, name, {"bfloat16": bf16, "float32": None}, hbm_gb, hbm_gb_per_s, link, pattern
    )


# Figures and sources: the module docstring. Order matters for `detect`: the first
# pattern that matches wins, so more specific names come first.
DEVICES: dict[str, Device] = {
    d.key: d
    for d in (
        _gpu("h200-nvl", "H200 NVL", 835.5, 60.0, 141, 4800.0, 900.0, r"h200.*nvl", 4),
        _gpu("h200-sxm", "H200 SXM", 989.4, 66.9, 141, 4800.0, 900.0, r"h200", 4),
        _gpu("h100-nvl", "H100 NVL", 835.5, 60.0, 94, 3900.0, 600.0, r"h100.*nvl", 4),
        _gpu("h100-pcie", "H100 PCIe", 756.5, 51.2, 80, 2000.0, 600.0, r"h100.*pcie", 4),
        _gpu("h100-sxm", "H100 SXM", 989.4, 66.9, 80, 3350.0, 900.0, r"h100", 4),
        _gpu(
            "a100-80gb-pcie",
            "A100 80GB PCIe",
            312.0,
            19.5,
            80,
            1935.0,
            600.0,
            r"a100.*(pcie.*80|80.*pcie)",
            3,
        ),
        _gpu("a100-80gb", "A100 80GB SXM", 312.0, 19.5, 80, 2039.0, 600.0, r"a100.*80", 3),
        _gpu("a100-40gb", "A100 40GB", 312.0, 19.5, 40, 1555.0, 600.0, r"a100", 3),
        _tpu("tpu-v4", "TPU v4", 275.0, 32 * 2**30 / 1e9, 1200.0, r"tpu v4(?! ?lite)"),
        _tpu("tpu-v5e", "TPU v5e", 197.0, 16, 819.0, r"tpu v5 ?(lite|e)", 400.0, 4),
        _tpu("tpu-v5p", "TPU v5p", 459.0, 95, 2765.0, r"tpu v5 ?p?$", 1200.0, 6),
        _tpu("tpu-v6e", "TPU v6e", 918.0, 32, 1640.0, r"tpu v6 ?(lite|e)"),
    )
}


def names() -> list[str]:
    """The keys `device` accepts, sorted.

    Example:
      >>> from shardfuse import hardware
      >>> "h100-sxm" in hardware.names()
      True
    """
    return sorted(DEVICES)


def device(name: str) -> Device:
    """The figures of the chip called `name`.

    Args:
      name: a key of `DEVICES`, e.g. "h100-sxm", "a100-80gb", "tpu-v5p".

    Returns:
      Its `Device`.

    Raises:
      ValueError: unknown `name` (the message lists the valid ones).

    Example:
      >>> from shardfuse import hardware
      >>> hardware.device("tpu-v5p").link.gb_per_s
      100.0
    """
    try:
        return DEVICES[name]
    except (KeyError, TypeError):
        raise ValueError(f"device {name!r} is not one of {names()}") from None


def detect(device_kind: str) -> Device | None:
    """The chip JAX calls `device_kind`, or None (CPU, chips not in the table).

    Args:
      device_kind: `jax.devices()[0].device_kind`, e.g. "NVIDIA H100 80GB HBM3",
        "TPU v5 lite", "cpu".

    Returns:
      The first `Device` whose `kind_pattern` matches, or None.

    Example:
      >>> from shardfuse import hardware
      >>> hardware.detect("TPU v5 lite").name
      'TPU v5e'
    """
    kind = str(device_kind).strip().lower()
    for candidate in DEVICES.values():
        if re.search(candidate.kind_pattern, kind):
            return candidate
    return None


def current_device() -> Device | None:
    """The `Device` of `jax.devices()[0]`, or None where the table has no entry (CPU).

    Example:
      >>> from shardfuse import hardware
      >>> hardware.current_device() is None  # on a CPU host  # doctest: +SKIP
      True
    """
    import jax

    return detect(jax.devices()[0].device_kind)
