"""`Plan`: a `Parallelism` with its predicted cost, and the options that run it.

A plan is data: the mesh sizes and options (`Parallelism`), the estimate that
ranked it (`Estimate`, every term named), and the inputs it was made for. It
builds its `jax.sharding.Mesh` (`plan.mesh(devices)`) and converts itself
into the run's options (`plan.run_options()`, an `sf.parallel.RunOptions`:
what `sf.parallel.parallelize` and the `Trainer` take; `plan.layer_options()`
the layers' share of them), so that a training script needs no hand-written glue.
"""

import dataclasses
import warnings

from shardfuse.hardware import Cluster
from shardfuse.model_spec import ModelSpec
from shardfuse.planner.cost import Estimate
from shardfuse.planner.options import MESH_AXES, Assumptions, Parallelism


@dataclasses.dataclass(frozen=True)
class Plan:
    """A `Parallelism` (mesh sizes and options) for `model` on `cluster`, with its predicted cost.

    Attributes:
      model, cluster: what it was planned for.
      global_batch, seq_len: sequences per step and tokens per sequence.
      parallelism: mesh sizes and options.
      estimate: the predicted FLOPs, step time, memory and their terms.
      assumptions: what the cost model assumed.

    Example usage::

      >>> import jax
      >>> from shardfuse import hardware, models
      >>> from shardfuse.planner import plan
      >>> best = plan(models.get("llama3-8b"), hardware.cluster("h100"), global_batch=64,
      ...             seq_len=8192)[0]
      >>> sorted(best.mesh_shape) == sorted(
      ...     ("pipeline", "data", "fsdp", "expert", "sequence", "model"))
      True
      >>> best.memory_bytes < 80e9
      True
    """

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    seq_len: int
    parallelism: Parallelism
    estimate: Estimate
    assumptions: Assumptions

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis name -> size, outermost (`pipeline`) to innermost (`model`)."""
        return self.parallelism.mesh_shape

    @property
    def layout(self) -> Parallelism:
        """Deprecated: `parallelism` ("layout" is the ring's token order)."""
        warnings.warn(
            "Plan.layout is deprecated and will be removed in the next release: use "
            "Plan.parallelism",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.parallelism

    @property
    def step_time_s(self) -> float:
        """Predicted seconds per training step."""
        return self.estimate.step_time_s

    @property
    def mfu(self) -> float:
        """Predicted model FLOPs utilisation."""
        return self.estimate.mfu

    @property
    def memory_bytes(self) -> float:
        """Predicted peak memory per device, bytes."""
        return self.estimate.memory_bytes

    def mesh(self, devices=None, *, axis_types=None):
        """The `jax.sharding.Mesh` of this plan over `devices` (axes in `MESH_AXES` order).

        Args:
          devices: as many devices as the plan has (default `jax.devices()`).
          axis_types: `jax.sharding.AxisType`s, one per axis (default Explicit).

        Raises:
          ValueError: the number of devices differs from the plan's.

        Example usage::

          >>> import jax
          >>> from shardfuse import hardware, models
          >>> from shardfuse.planner import plan
          >>> tiny = models.ModelSpec("tiny", hidden=64, heads=4, kv_heads=2, head_dim=16,
          ...                         ffn_hidden=128, num_layers=2, vocab_size=256)
          >>> cpu = hardware.cluster("h100", devices_per_node=8)
          >>> p = plan(tiny, cpu, global_batch=8, seq_len=64)[0]
          >>> dict(p.mesh(jax.devices()[:8]).shape) == p.mesh_shape
          True
        """
        import jax

        devices = list(jax.devices() if devices is None else devices)
        n = self.parallelism.num_devices
        if len(devices) != n:
            raise ValueError(f"devices has {len(devices)} devices, the plan needs {n}")
        shape = tuple(self.mesh_shape[axis] for axis in MESH_AXES)
        kwargs = {} if axis_types is None else {"axis_types": tuple(axis_types)}
        return jax.make_mesh(shape, MESH_AXES, devices=devices, **kwargs)

    def run_options(self):
        """The plan as `sf.parallel.RunOptions`: what `sf.parallel.parallelize` applies.

        Its `parallelism.options` (ZeRO stage, remat, prefetch, microbatches,
        pipeline schedule and virtual stages), with the sequence parallelism the
        cost model assumed and the mesh sizes (`parallelize` checks its mesh
        against them).

        Example usage::

          >>> import shardfuse as sf
          >>> best = sf.plan(sf.models.get("llama3-8b"), sf.hardware.cluster("h100", nodes=1),
          ...                global_batch=64, seq_len=4096)[0]
          >>> options = best.run_options()
          >>> options.replace(mesh_shape=None) == best.parallelism.options
          True
          >>> options.mesh_shape == best.mesh_shape
          True
        """
        return self.parallelism.options.replace(
            sequence_parallel=self.assumptions.sequence_parallel,  # as the cost model assumed
            mesh_shape=dict(self.mesh_shape),
        )

    def layer_options(self, mesh=None, **changes):
        """The plan's `sf.layers.LayerOptions` (`run_options().layer_options`): ZeRO, remat,
        sequence parallelism, for layers built by hand on `mesh`; `changes` set other fields.

        The remat policy is that of each layer of a `sf.layers.Stack`: build the
        blocks inside it with `options.replace(remat="none")`.

        Example usage::

          >>> import shardfuse as sf
          >>> best = sf.plan(sf.models.get("llama3-8b"), sf.hardware.cluster("h100", nodes=1),
          ...                global_batch=64, seq_len=4096)[0]
          >>> options = best.layer_options()
          >>> (options.zero, options.remat) == (best.parallelism.options.zero,
          ...                                   best.parallelism.options.remat)
          True
        """
        return self.run_options().layer_options(mesh, **changes)

    def to_dict(self) -> dict:
        """A JSON-ready dict: mesh, options, step time, MFU, memory and every term.

        Example usage::

          >>> import json
          >>> from shardfuse import hardware, models
          >>> from shardfuse.planner import plan
          >>> d = plan(models.get("llama3-8b"), hardware.cluster("h100"), global_batch=64,
          ...          seq_len=8192)[0].to_dict()
          >>> sorted(d["mesh"]) == sorted(
          ...     ["pipeline", "data", "fsdp", "expert", "sequence", "model"])
          True
          >>> json.loads(json.dumps(d)) == d
          True
        """
        e, parallelism = self.estimate, self.parallelism
        options = parallelism.choices()
        return dict(
            model=self.model.name,
            cluster=self.cluster.describe(),
            devices=parallelism.num_devices,
            global_batch=self.global_batch,
            seq_len=self.seq_len,
            mesh=dict(self.mesh_shape),
            options=options,
            step_time_s=e.step_time_s,
            mfu=e.mfu,
            tflops_per_device=e.tflops_per_device,
            memory_bytes=e.memory_bytes,
            memory_limit_bytes=e.memory_limit_bytes,
            model_flops=e.model_flops,
            hardware_flops=e.hardware_flops,
            time_terms={t.name: t.value for t in e.time},
            communication_total_s={t.name: t.total for t in e.time if t.total is not None},
            memory_terms={t.name: t.value for t in e.memory},
            assumptions=self.assumptions.to_dict(self.cluster.device),
        )

    def versus(self, better: "Plan") -> str:
        """Why this plan lost to `better`: the step-time gap and the terms that make it.

        Example usage::

          >>> from shardfuse import hardware
          >>> from shardfuse.planner import plan
          >>> first, second = plan("llama3-8b", hardware.cluster("h100"), global_batch=64,
          ...                      seq_len=8192, top_k=2)
          >>> second.versus(first).startswith("+")
          True
        """
        mine = {t.name: t.value for t in self.estimate.time}
        theirs = {t.name: t.value for t in better.estimate.time}
        gaps = sorted(((mine.get(k, 0.0) - theirs.get(k, 0.0), k) for k in set(mine) | set(theirs)),
                      key=lambda g: -abs(g[0]))  # fmt: skip
        gap = self.step_time_s - better.step_time_s
        parts = [f"{name} {d:+.3g} s" for d, name in gaps if abs(d) > 1e-3 * better.step_time_s]
        text = f"{gap:+.3g} s ({gap / better.step_time_s:+.1%})"
        text += ": " + ", ".join(parts[:4]) if parts else ": the same terms"
        if abs(gap) <= 1e-3 * better.step_time_s:
            text += " (a tie within 0.1%, broken by the stated rule)"
        return text

    def summary(self) -> str:
        """One line: mesh, options, step time, MFU, memory."""
        mesh = " ".join(f"{k[0]}{v}" for k, v in self.mesh_shape.items() if v > 1) or "1 device"
        return (
            f"{mesh} | {self.options_text()} | {self.step_time_s:.3g} s | "
            f"MFU {self.mfu:.1%} | {self.memory_bytes / 1e9:.1f} GB"
        )

    def options_text(self) -> str:
        """The options that matter for this parallelism, compactly."""
        parallelism = self.parallelism
        options = parallelism.options
        parts = [
            f"zero={options.zero}",
            f"remat={options.remat}",
            f"mb={parallelism.microbatch_size}x{options.num_microbatches}",
        ]
        if options.prefetch:
            parts.append("prefetch")
        if parallelism.pipeline > 1:
            virtual = options.virtual_stages
            parts.append(options.schedule + (f"/v{virtual}" if virtual > 1 else ""))
        if parallelism.sequence > 1:
            parts.append(parallelism.cp_strategy)
        return " ".join(parts)

    def explain(self) -> str:
        """Every term of the estimate, with its formula, as text.

        Example usage::

          >>> from shardfuse import hardware, models
          >>> from shardfuse.planner import plan
          >>> text = plan(models.get("llama3-8b"), hardware.cluster("h100"), global_batch=64,
          ...             seq_len=8192)[0].explain()
          >>> "compute" in text and "optimizer" in text
          True
        """
        e = self.estimate
        peak = self.cluster.device.peak_tflops(self.assumptions.compute_dtype)
        lines = [
            f"{self.model.name} on {self.cluster.describe()}, global batch {self.global_batch} "
            f"x {self.seq_len} tokens",
            f"mesh {self.mesh_shape}, {self.options_text()}",
            f"model FLOPs/step {e.model_flops:.4g}, hardware FLOPs/step {e.hardware_flops:.4g} "
            f"({e.tflops_per_device:.1f} TFLOP/s per device of {peak} peak, MFU {e.mfu:.1%})",
            f"step time {e.step_time_s:.4g} s =",
        ]
        lines += [
            f"  {t.name:18} {t.value:10.4g} s   "
            + (f"(exposed of {t.total:.4g} s) " if t.total is not None else "")
            + t.formula
            for t in e.time
        ]
        a = self.assumptions.to_dict(self.cluster.device)
        lines.append(
            f"assumptions {a['name']!r}: matmul efficiency {a['compute_efficiency']:.3g}, overlap "
            f"{a['overlap']:g}, pipeline executor {a['pipeline_executor']}"
            + (" (stage recompute)" if a["pipeline_recompute"] else "")
            + f", flash attention {a['flash_attention']}, sequence parallel "
            f"{a['sequence_parallel']} (all fields: --json)"
        )
        limit = e.memory_limit_bytes / 1e9
        lines.append(f"memory per device {e.memory_bytes / 1e9:.4g} GB (fits in {limit:.4g} GB) =")
        lines += [f"  {t.name:18} {t.value / 1e9:10.4g} GB  {t.formula}" for t in e.memory]
        return "\n".join(lines)
