"""`shardfuse info`: what this machine has and which implementations can run on it."""

import importlib.util
import platform as _platform

import jax


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _triton_status(backend: str) -> tuple[bool, str]:
    """Whether the Triton kernels can launch here: the launcher's own checks (NVIDIA GPU of
    compute capability >= 8.0, triton and jax-triton importable with this jaxlib)."""
    from shardfuse.kernels.attention.triton_launch import gpu_launcher

    try:
        launcher = gpu_launcher()
    except NotImplementedError as e:
        return False, str(e)
    return True, f"sm_{launcher.compute_capability}: triton and jax-triton available"


def _module_status(module_name: str) -> tuple[bool, str] | None:
    """None when the implementation module exists, else (False, reason)."""
    if not _has_module(module_name):
        return False, "not part of this version of shardfuse"
    return None


def implementation_status(op_implementations: dict[str, tuple[str, str]], backend: str):
    """`{name: (usable, why)}` for the implementations of one op on this backend."""
    status = {}
    for name, (module_name, _) in op_implementations.items():
        missing = _module_status(module_name)
        if missing is not None:
            status[name] = missing
        elif name == "reference":
            status[name] = (True, "plain jnp, runs anywhere (slow, O(T*S) memory)")
        elif name == "xla":
            status[name] = (True, "portable blockwise JAX, runs anywhere")
        elif name == "pallas_tpu":
            if backend == "tpu":
                status[name] = (True, "TPU: Mosaic kernels")
            else:
                status[name] = (True, f"no TPU: runs in TPU interpret mode on {backend} (slow)")
        elif name == "triton":
            status[name] = _triton_status(backend)
        else:
            status[name] = (True, "")
    return status


def info(print_report: bool = True) -> dict:
    """Reports versions, backend, devices and which implementations are usable here.

    Args:
      print_report: print a table (with rich) as well as returning the data.

    Returns:
      A dict with keys "shardfuse", "python", "jax", "jaxlib", "flax", "backend",
      "devices" (list of str) and "implementations" (`{op: {name: (usable, why)}}`).

    Example:
      >>> import shardfuse as sf
      >>> report = sf.info(print_report=False)
      >>> report["implementations"]["attention"]["xla"][0]
      True
    """
    import flax
    import jaxlib

    import shardfuse
    from shardfuse.kernels.attention.api import IMPLEMENTATIONS as ATTENTION

    backend = jax.default_backend()
    ops = {"attention": ATTENTION}
    try:
        from shardfuse.kernels.matmul.api import IMPLEMENTATIONS as MATMUL

        ops["matmul"] = MATMUL
    except ImportError:
        pass
    report = {
        "shardfuse": shardfuse.__version__,
        "python": _platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "backend": backend,
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
        "implementations": {op: implementation_status(impls, backend) for op, impls in ops.items()},
    }
    if print_report:
        _print(report)
    return report


def _print(report):
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"shardfuse {report['shardfuse']}  python {report['python']}  jax {report['jax']}  "
        f"jaxlib {report['jaxlib']}  flax {report['flax']}"
    )
    devices = report["devices"]
    console.print(f"backend: {report['backend']}  devices ({len(devices)}): {', '.join(devices)}")
    table = Table(title="implementations")
    for column in ("op", "implementation", "usable", "why"):
        table.add_column(column)
    for op, impls in report["implementations"].items():
        for name, (usable, why) in impls.items():
            table.add_row(op, name, "yes" if usable else "no", why)
    console.print(table)
