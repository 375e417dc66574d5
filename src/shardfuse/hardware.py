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
  TPU v4:  https://cloud.google.com/tpu/docs/v4  : 275 bf16 TFLOP/s, 32 GiB HBM2 at 1,200 GB/s,
    3D torus (6 ICI links); the page gives 1.1 PB/s all-reduce bandwidth per 4096-chip pod
    (~270 GB/s per chip); Jouppi et al. 2023 ("TPU v4: An Optically Reconfigurable
    Supercomputer", ISCA) give 6 links of 50 GB/s each way: 600 GB/s both ways per chip.
  TPU v5e: https://cloud.google.com/tpu/docs/v5e : 197 bf16 TFLOP/s, 16 GB HBM2 at 819 GB/s,
    ICI 400 GB/s bidirectional per chip over 4 ports (2D torus).
  TPU v5p: https://cloud.google.com/tpu/docs/v5p : 459 bf16 TFLOP/s, 95 GB HBM2e at 2,765 GB/s,
    ICI 1,200 GB/s bidirectional per chip over 6 links (3D torus).
  TPU v6e: https://cloud.google.com/tpu/docs/v6e : 918 bf16 TFLOP/s, 32 GB HBM at 1,640 GB/s,
    ICI 800 GB/s bidirectional per chip over 4 ports (2D torus), 256-chip pods.

Inter-node links (`Cluster`): a GPU node is one 8-GPU server (DGX/HGX) with one
InfiniBand NIC per GPU: DGX A100 8x HDR 200 Gb/s (25 GB/s per GPU each way,
the Selene cluster of Narayanan et al. 2021), DGX H100/H200 8x NDR 400 Gb/s
(50 GB/s per GPU). A TPU "node" is one ICI-connected slice (the pod sizes
above: v4 4096, v5e 256, v5p 8960, v6e 256 chips); slices talk over the data
center network: v5p 50 Gb/s DCN per chip (6.25 GB/s, the v5p page), v5e
2 x 100 Gb/s per 8-chip host (3.125 GB/s per chip, the v5e page); v4 and v6e
are taken equal to v5p and v5e. Latencies are typical one-hop figures, not
datasheet values: 3 us for NVLink/ICI, 10 us for InfiniBand/DCN.

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
      latency_us: the fixed cost of one transfer (launch and synchronisation), us.
    """

    name: str
    gb_per_s: float
    egress_gb_per_s: float
    latency_us: float = 3.0

    def __post_init__(self):
        for field in ("gb_per_s", "egress_gb_per_s"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"Link.{field}={value!r} must be a number > 0")
        if not (isinstance(self.latency_us, int | float) and self.latency_us >= 0):
            raise ValueError(f"Link.latency_us={self.latency_us!r} must be a number >= 0")


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
        _tpu("tpu-v4", "TPU v4", 275.0, 32 * 2**30 / 1e9, 1200.0, r"tpu v4(?! ?lite)", 600.0, 6),
        _tpu("tpu-v5e", "TPU v5e", 197.0, 16, 819.0, r"tpu v5 ?(lite|e)", 400.0, 4),
        _tpu("tpu-v5p", "TPU v5p", 459.0, 95, 2765.0, r"tpu v5 ?p?$", 1200.0, 6),
        _tpu("tpu-v6e", "TPU v6e", 918.0, 32, 1640.0, r"tpu v6 ?(lite|e)", 800.0, 4),
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


def compute_capability(device=None) -> int:
    """The CUDA compute capability of `device` (default: JAX's first) as an int, e.g. 90 for
    an H100; 0 for a device that reports none (a CPU, a TPU).

    Example:
      >>> compute_capability()  # on this CPU
      0
    """
    import jax

    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return 0
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return 10 * major + minor


def current_device() -> Device | None:
    """The `Device` of `jax.devices()[0]`, or None where the table has no entry (CPU).

    Example:
      >>> from shardfuse import hardware
      >>> hardware.current_device() is None  # on a CPU host  # doctest: +SKIP
      True
    """
    import jax

    return detect(jax.devices()[0].device_kind)


# ---- clusters ---------------------------------------------------------------

# Short names `cluster` accepts besides the keys of `DEVICES`.
ALIASES = {
    "a100": "a100-80gb",
    "h100": "h100-sxm",
    "h200": "h200-sxm",
    "v4": "tpu-v4",
    "v5e": "tpu-v5e",
    "v5p": "tpu-v5p",
    "v6e": "tpu-v6e",
}

# Per device family: (devices per node, inter-node link). Sources: the module docstring.
_IB_HDR = Link("InfiniBand HDR", 25.0, 25.0, latency_us=10.0)
_IB_NDR = Link("InfiniBand NDR", 50.0, 50.0, latency_us=10.0)
_DCN_V5P = Link("DCN", 6.25, 6.25, latency_us=10.0)
_DCN_V5E = Link("DCN", 3.125, 3.125, latency_us=10.0)
_NODES = {
    "a100": (8, _IB_HDR),
    "h100": (8, _IB_NDR),
    "h200": (8, _IB_NDR),
    "tpu-v4": (4096, _DCN_V5P),
    "tpu-v5e": (256, _DCN_V5E),
    "tpu-v5p": (8960, _DCN_V5P),
    "tpu-v6e": (256, _DCN_V5E),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`nodes` x `devices_per_node` chips of one kind, with their intra- and inter-node links.

    Devices are numbered node-major (device `i` sits on node `i // devices_per_node`),
    the order of `jax.devices()` on GPU clusters and TPU slices. A mesh axis whose
    devices all sit on one node talks over `intra_link`; any other over `inter_link`.

    Attributes:
      device: the chip.
      nodes: number of nodes (servers, or TPU slices).
      devices_per_node: chips per node.
      intra_link: the link inside a node (NVLink, ICI).
      inter_link: the link between nodes (InfiniBand, DCN), per chip, one direction.

    Example:
      >>> from shardfuse import hardware
      >>> c = hardware.cluster("h100", nodes=8)
      >>> c.num_devices, c.intra_link.gb_per_s, c.inter_link.gb_per_s
      (64, 450.0, 50.0)
    """

    device: Device
    nodes: int
    devices_per_node: int
    intra_link: Link
    inter_link: Link

    def __post_init__(self):
        for field in ("nodes", "devices_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{field}={value!r} must be a positive int")

    @property
    def num_devices(self) -> int:
        """`nodes * devices_per_node`."""
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        """One line: "8 x 8 H100 SXM (NVLink 4 450 GB/s, InfiniBand NDR 50 GB/s)"."""
        return (
            f"{self.nodes} x {self.devices_per_node} {self.device.name} "
            f"({self.intra_link.name} {self.intra_link.gb_per_s:g} GB/s, "
            f"{self.inter_link.name} {self.inter_link.gb_per_s:g} GB/s)"
        )


def resolve(name: "str | Device") -> Device:
    """A `Device` from a key of `DEVICES`, a short alias ("h100", "v5p") or a `Device`.

    Example:
      >>> from shardfuse import hardware
      >>> hardware.resolve("h100").key
      'h100-sxm'
    """
    if isinstance(name, Device):
        return name
    if isinstance(name, str) and name.lower() in ALIASES:
        name = ALIASES[name.lower()]
    try:
        return DEVICES[name]
    except (KeyError, TypeError):
        valid = sorted(set(DEVICES) | set(ALIASES))
        raise ValueError(f"device {name!r} is not one of {valid}") from None


def cluster(
    device: "str | Device",
    nodes: int = 1,
    *,
    devices_per_node: int | None = None,
    inter_link: Link | None = None,
) -> Cluster:
    """A cluster of `nodes` nodes of `device` chips.

    Args:
      device: a key of `DEVICES`, an alias of `ALIASES` ("h100", "a100", "v5p") or a `Device`.
      nodes: number of nodes (8-GPU servers, or TPU slices), default 1.
      devices_per_node: chips per node; default 8 for GPUs, the pod size for TPUs
        (a smaller slice: pass its chip count).
      inter_link: override the inter-node link (default: the module docstring's).

    Returns:
      The `Cluster`.

    Raises:
      ValueError: unknown device, a device without link figures, or a size that
        is not a positive int.

    Example:
      >>> from shardfuse import hardware
      >>> hardware.cluster("a100", nodes=4).num_devices
      32
      >>> hardware.cluster("v5p", devices_per_node=256).inter_link.name
      'DCN'
    """
    chip = resolve(device)
    if chip.link is None:
        raise ValueError(f"device {chip.key!r} has no link figures in shardfuse.hardware")
    family = next((k for k in _NODES if chip.key.startswith(k)), None)
    default_per_node, default_inter = _NODES.get(family, (8, _IB_NDR))
    per_node = default_per_node if devices_per_node is None else devices_per_node
    return Cluster(chip, nodes, per_node, chip.link, inter_link or default_inter)
