"""Peak dense throughput and memory bandwidth per accelerator, for "% of peak".

Numbers are the vendors' dense (no 2:4 sparsity) tensor-core / MXU peaks per
chip (one GPU, one TPU chip), and HBM bandwidth per chip. `float32` is the
non-tensor-core FP32 peak on GPUs, the rate `Precision.HIGHEST` float32
matmuls get; TPUs publish no float32 peak, so it is None there ("n/a").

Sources (vendor datasheets and product pages):
  H100 SXM / NVL / PCIe: https://www.nvidia.com/en-us/data-center/h100/ and the
    "NVIDIA H100 Tensor Core GPU" datasheet: BF16/FP16 1,979 (SXM), 1,671 (NVL),
    1,513 (PCIe) TFLOP/s *with sparsity*, so dense = half; FP32 67 / 60 / 51;
    HBM 3.35 / 3.9 / 2.0 TB/s.
  H200 SXM / NVL: https://www.nvidia.com/en-us/data-center/h200/ : same tensor
    compute as H100 (BF16 1,979 sparse -> 989 dense on SXM), HBM3e 4.8 TB/s.
  A100: https://www.nvidia.com/en-us/data-center/a100/ : BF16 312 dense,
    FP32 19.5; HBM 2,039 GB/s (80GB SXM), 1,935 GB/s (80GB PCIe), 1,555 GB/s (40GB).
  TPU v4:  https://cloud.google.com/tpu/docs/v4  : 275 bf16 TFLOP/s, 1,200 GB/s.
  TPU v5e: https://cloud.google.com/tpu/docs/v5e : 197 bf16 TFLOP/s, 819 GB/s.
  TPU v5p: https://cloud.google.com/tpu/docs/v5p : 459 bf16 TFLOP/s, 2,765 GB/s.
  TPU v6e: https://cloud.google.com/tpu/docs/v6e : 918 bf16 TFLOP/s, 1,640 GB/s.

CPUs have no entry: their "% of peak" is "n/a".
"""

import dataclasses
import re

NOT_AVAILABLE = "n/a"


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Peaks of one accelerator chip.

    Attributes:
      name: the short name used in reports ("H100 SXM", "TPU v5p").
      tflops: dense peak TFLOP/s per dtype name ("bfloat16", "float16",
        "float32"); a missing dtype or None means no published peak.
      hbm_gb_per_s: HBM bandwidth in GB/s (1e9 bytes per second).
    """

    name: str
    tflops: dict
    hbm_gb_per_s: float

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for `dtype`, or None when none is published."""
        return self.tflops.get(str(dtype))


def _gpu(name, bf16, fp32, hbm):
    return DevicePeak(name, {"bfloat16": bf16, "float16": bf16, "float32": fp32}, hbm)


def _tpu(name, bf16, hbm):
    return DevicePeak(name, {"bfloat16": bf16, "float32": None}, hbm)


# (pattern on the lower-cased `jax.Device.device_kind`, peak); first match wins,
# so the more specific names come first.
PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    (r"h200.*nvl", _gpu("H200 NVL", 835.5, 60.0, 4800.0)),
    (r"h200", _gpu("H200 SXM", 989.4, 66.9, 4800.0)),
    (r"h100.*nvl", _gpu("H100 NVL", 835.5, 60.0, 3900.0)),
    (r"h100.*pcie", _gpu("H100 PCIe", 756.5, 51.2, 2000.0)),
    (r"h100", _gpu("H100 SXM", 989.4, 66.9, 3350.0)),
    (r"a100.*(pcie.*80|80.*pcie)", _gpu("A100 80GB PCIe", 312.0, 19.5, 1935.0)),
    (r"a100.*80", _gpu("A100 80GB SXM", 312.0, 19.5, 2039.0)),
    (r"a100", _gpu("A100 40GB", 312.0, 19.5, 1555.0)),
    (r"tpu v4(?! ?lite)", _tpu("TPU v4", 275.0, 1200.0)),
    (r"tpu v5 ?(lite|e)", _tpu("TPU v5e", 197.0, 819.0)),
    (r"tpu v5 ?p?$", _tpu("TPU v5p", 459.0, 2765.0)),
    (r"tpu v6 ?(lite|e)", _tpu("TPU v6e", 918.0, 1640.0)),
)


def device_peak(device_kind: str) -> DevicePeak | None:
    """The peaks of a device kind as JAX names it, or None (CPU, unknown chips).

    Args:
      device_kind: `jax.devices()[0].device_kind`, e.g. "NVIDIA H100 80GB HBM3",
        "TPU v5 lite", "cpu".

    Returns:
      The matching `DevicePeak`, or None when the table has no entry.

    Example:
      >>> from shardfuse.bench.peaks import device_peak
      >>> device_peak("NVIDIA H100 80GB HBM3").peak_tflops("bfloat16")
      989.4
      >>> device_peak("cpu") is None
      True
    """
    kind = str(device_kind).strip().lower()
    for pattern, peak in PEAKS:
        if re.search(pattern, kind):
            return peak
    return None


def percent_of_peak(achieved: float | None, peak: float | None):
    """`100 * achieved / peak`, or "n/a" when either is unknown.

    Example:
      >>> from shardfuse.bench.peaks import percent_of_peak
      >>> percent_of_peak(494.7, 989.4)
      50.0
      >>> percent_of_peak(1.0, None)
      'n/a'
    """
    if achieved is None or not peak:
        return NOT_AVAILABLE
    return 100.0 * achieved / peak
