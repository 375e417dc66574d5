"""`shardfuse info`: what this machine has and which implementations can run on it.

Every row comes from the registry (`kernels/registry.py`): each registered op,
each of its backends with its own description, whether it can run here and
why, and the order `implementation=None` tries them in on this platform.
"""

import platform as _platform

import jax

from shardfuse._version import __version__
from shardfuse.kernels import registry


def info(print_report: bool = True) -> dict:
    """Reports versions, backend, devices and which implementations are usable here.

    Args:
      print_report: print a table (with rich) as well as returning the data.

    Returns:
      A dict with keys "shardfuse", "python", "jax", "jaxlib", "flax",
      "backend", "devices" (list of str), "implementations"
      (`{op: {name: (usable, why)}}`), "descriptions" (`{op: {name: text}}`,
      the op's own text under `""`) and "preference" (`{op: names}`, what
      `implementation=None` tries here, in order), for every registered op, and
      "rules" (`{op: text}`) for ops whose choice here depends on the case (attention on
      an NVIDIA GPU: the fastest backend measured for the case).

    Example:
      >>> import shardfuse as sf
      >>> report = sf.info(print_report=False)
      >>> report["implementations"]["attention"]["xla"][0]
      True
      >>> "all_gather_matmul" in report["implementations"]
      True
    """
    import flax
    import jaxlib

    backend = jax.default_backend()
    ops = registry.ops()
    report = {
        "shardfuse": __version__,
        "python": _platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "backend": backend,
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
        "implementations": {name: op.status(backend) for name, op in ops.items()},
        "descriptions": {
            name: {"": op.description} | {b.name: b.description for b in op.backends.values()}
            for name, op in ops.items()
        },
        "preference": {name: op.candidates(None) for name, op in ops.items()},
        "rules": {name: op.rule_text(backend) for name, op in ops.items() if op.rule_text(backend)},
    }
    if print_report:
        _print(report)
    return report


def _print(report):
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 120))  # a pipe or a file: no ragged wrapping
    console.print(
        f"shardfuse {report['shardfuse']}  python {report['python']}  jax {report['jax']}  "
        f"jaxlib {report['jaxlib']}  flax {report['flax']}"
    )
    devices = report["devices"]
    console.print(f"backend: {report['backend']}  devices ({len(devices)}): {', '.join(devices)}")
    table = Table(title="implementations (default: the order implementation=None tries them in)")
    for column in ("op / implementation", "usable", "default", "what it is", "why"):
        table.add_column(column, no_wrap=column in ("op / implementation", "usable", "default"))
    for op, impls in report["implementations"].items():
        descriptions = report["descriptions"][op]
        preference = report["preference"][op]
        table.add_row(op, "", "", descriptions[""], "", style="bold")
        for name, (usable, why) in impls.items():
            order = str(preference.index(name) + 1) if name in preference else ""
            usable = "yes" if usable else "no"
            table.add_row(f"  {name}", usable, order, descriptions[name], why)
        table.add_section()
    console.print(table)
    for op, rule in report.get("rules", {}).items():
        console.print(f"{op}, implementation=None: {rule}")
