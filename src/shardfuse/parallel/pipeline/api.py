"""`Pipeline`: a `Stack` run as a pipeline over a mesh axis, its loss a `custom_vjp`.

`Pipeline.loss` returns the token-weighted loss of `head` on the stack's
output. It composes with `jax.grad` / `nnx.value_and_grad` like any loss: it
is a `jax.custom_vjp` whose forward runs the WHOLE schedule (forward and
backward ticks, `executor.run_schedule`) and keeps the gradients of the
stack, the head and the input as residuals (the input's only when the caller
differentiates the input: `custom_vjp(symbolic_zeros)` tells); its backward
scales them by the incoming cotangent. Undifferentiated it runs the same
program and returns the loss; `Pipeline.forward` is the evaluation path
(forward ticks only). The embedding runs before the pipeline and gets its
gradient through the input's cotangent; a head that shares the embedding's
`nnx.Param` (tied embeddings) gets the sum of both ends from autodiff.

Blocks holding a `ParallelMoE`: each stage returns its layers' aux-loss term per
microbatch next to its output and the loss adds it weighted by the microbatch's tokens,
as the unpipelined step (`Pipeline.loss`'s `aux_loss_coef`, `z_loss_coef`).

Microbatch `i` is rows `i, i + m, i + 2m, ...` of the batch (a strided split:
a batch sharded over the data axes stays where it is, and `[B, ...]` ->
`[B/m, m, ...]` is a reshape, no copy), so the loss, a sum over tokens
divided by the total weight, does not depend on the split.
"""

import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse.collectives.sharding import check_activations, check_divisible, place
from shardfuse.layers.loss import token_loss
from shardfuse.layers.stack import Stack, check_head
from shardfuse.parallel.pipeline.lockstep import lockstep_table
from shardfuse.parallel.pipeline.program import (
    Config,
    forward_program,
    pipelined_loss,
    pure,
    pure_without_stats,
    spec_axes,
    spec_tree,
)
from shardfuse.parallel.pipeline.residuals import check_residuals
from shardfuse.parallel.pipeline.schedule import check_schedule, schedule_table

__all__ = ["Pipeline"]


class Pipeline(nnx.Module):
    """`stack` split into stages over `pipeline_axis`, run by one of the schedules.

    Stage `s` of `p` holds layers `[s L/p, (s+1) L/p)` (v = 1), or with a
    stack built with `stage_layers` (uneven stages, e.g. 10 layers over 4 as
    `(3, 3, 2, 2)`: `sf.parallel.balance_stages`) the next `stage_layers[s]`; with
    `virtual_stages=v` (schedule "interleaved") it holds chunks
    `s, s + p, ..., s + (v-1) p` of `v p` chunks of `L / (v p)` layers each.
    Everything runs in one `jax.shard_map` over all mesh axes: the blocks'
    tensor/sequence/data parallelism runs inside each stage.

    Args:
      stack: a `shardfuse.layers.stack.Stack`; best created with
        `layer_axis=pipeline_axis` (then, for v = 1, no parameter moves).
      mesh: the mesh; must have `pipeline_axis`.
      schedule: "gpipe", "1f1b", "interleaved" or "zb-h1".
      num_microbatches: m (>= p except for gpipe; a multiple of p for interleaved).
      virtual_stages: v, model chunks per stage (interleaved only).
      pipeline_axis: the mesh axis of the stages.
      io_spec: PartitionSpec of the `[B, T, F]` activations between blocks
        (default: the block's `io_spec()`, else replicated).
      residuals: how a backward tick gets the stage's activations:
        "recompute" (default: it reruns the stage forward from the kept stage
        input, so a stage holds only its inputs in flight, the memory-bounded
        1F1B) or "stored" (the forward tick keeps the residuals of the stage's
        VJP for each microbatch in flight until its backward: no second
        forward, but every in-flight microbatch's activations held; with
        remat "full" blocks, one input per layer). Gradients are the same.

    Raises:
      ValueError: a mesh without `pipeline_axis`, an invalid schedule or
        (p, m, v), `num_layers` not divisible by `p * v` (without the
        stack's `stage_layers`; with them: v > 1 or another axis), or
        `residuals` not "recompute" or "stored".

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> from shardfuse.layers.stack import Stack
      >>> from shardfuse.parallel.pipeline.api import Pipeline
      >>> mesh = jax.make_mesh((2, 2), ("pipeline", "model"))
      >>> block = lambda rngs: sf.layers.ParallelTransformerBlock(16, 2, 32, mesh=mesh, rngs=rngs)
      >>> stack = Stack(block, 4, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
      >>> pipe = Pipeline(stack, mesh=mesh, schedule="1f1b", num_microbatches=2)
      >>> head = sf.layers.ColumnParallelLinear(16, 32, mesh=mesh, sequence_parallel=True,
      ...                                       gather_output=True, rngs=nnx.Rngs(1))
      >>> x = jnp.ones((4, 8, 16))
      >>> targets = jnp.zeros((4, 8), jnp.int32)
      >>> loss = pipe.loss(x, targets, head=head, targets_spec=jax.P())
      >>> loss.shape, bool(jnp.isfinite(loss))
      ((), True)
    """

    def __init__(
        self,
        stack,
        *,
        mesh,
        schedule: str = "1f1b",
        num_microbatches: int,
        virtual_stages: int = 1,
        pipeline_axis: str = axes.PIPELINE,
        io_spec=None,
        residuals: str = "recompute",
    ):
        if not isinstance(stack, Stack):
            raise TypeError(f"stack must be a shardfuse.layers.stack.Stack, got {type(stack)}")
        if pipeline_axis not in mesh.axis_names:
            raise ValueError(
                f"pipeline_axis={pipeline_axis!r} is not an axis of the mesh; its axes are "
                f"{tuple(mesh.axis_names)}"
            )
        p = int(mesh.shape[pipeline_axis])
        self.residuals = check_residuals(residuals)
        check_schedule(schedule, p, num_microbatches, virtual_stages)
        if stack.stage_layers is not None:  # uneven stages: the stack's own split
            if stack.layer_axis != pipeline_axis or virtual_stages != 1:
                raise ValueError(
                    f"a Stack with stage_layers={stack.stage_layers} runs with virtual_stages=1 "
                    f"on its layer_axis={stack.layer_axis!r}; got pipeline_axis="
                    f"{pipeline_axis!r}, virtual_stages={virtual_stages}"
                )
        elif stack.num_layers % (p * virtual_stages):
            raise ValueError(
                f"num_layers={stack.num_layers} must be divisible by p * virtual_stages = "
                f"{p} * {virtual_stages} = {p * virtual_stages} (pipeline axis "
                f"{pipeline_axis!r} of size {p})"
            )
        self.stack, self.mesh, self.schedule = stack, mesh, schedule
        self.num_microbatches, self.virtual_stages = int(num_microbatches), int(virtual_stages)
        self.pipeline_axis, self.num_stages = pipeline_axis, p
        if io_spec is None:
            io_spec = stack.blocks.io_spec() if hasattr(stack.blocks, "io_spec") else P()
        self.io_spec = io_spec
        # Tests: NaN in every ring buffer and every transfer no action sends.
        self.poison_buffers = False
        if pipeline_axis in spec_axes(io_spec):
            raise ValueError(f"io_spec={io_spec} must not use the pipeline axis {pipeline_axis!r}")

    def lockstep(self, *, forward_only: bool = False):
        """The `LockstepTable` the executor runs (`lockstep.lockstep_table`)."""
        return lockstep_table(
            self.schedule,
            self.num_stages,
            self.num_microbatches,
            self.virtual_stages,
            forward_only=forward_only,
        )

    def table(self, *, forward_only: bool = False):
        """The schedule's `ScheduleTable` (one action per stage and tick, as drawn)."""
        return schedule_table(
            self.schedule,
            self.num_stages,
            self.num_microbatches,
            self.virtual_stages,
            forward_only=forward_only,
        )

    def _check_batch(self, x, targets=None, weights=None):
        check_activations(x)
        features = self.stack.features
        if features is not None and (x.ndim < 1 or x.shape[-1] != features):
            raise ValueError(
                f"x has shape {x.shape}; the stack's blocks take [B, T, features={features}]"
            )
        m = self.num_microbatches
        if x.ndim < 1 or x.shape[0] % m:
            raise ValueError(
                f"x has batch size {x.shape[0] if x.ndim else None} (shape {x.shape}); it must be "
                f"divisible by num_microbatches={m}"
            )
        batch_axes = self.io_spec[0] if len(self.io_spec) else None
        check_divisible(
            "the microbatch size x.shape[0] / num_microbatches",
            x.shape[0] // m,
            self.mesh,
            batch_axes,
        )
        if x.ndim >= 2 and len(self.io_spec) >= 2:  # the blocks' sequence split
            check_divisible("the sequence length x.shape[1]", x.shape[1],
                            self.mesh, self.io_spec[1])  # fmt: skip
        for name, value in (("targets", targets), ("weights", weights)):
            if value is not None and tuple(value.shape) != tuple(x.shape[: value.ndim]):
                raise ValueError(
                    f"{name} has shape {value.shape}; expected the leading dimensions of x "
                    f"{tuple(x.shape[:2])}"
                )

    def forward(self, x):
        """The stack's output `[B, T, F]` for input `x`, by the schedule's forward ticks."""
        self._check_batch(x)
        graphdef, values, specs, template = pure_without_stats(self.stack.blocks)
        x = place(x, self.mesh, P(*self.io_spec))
        return forward_program(self._config(graphdef, specs, template), values, x)

    def loss(
        self,
        x,
        targets,
        *,
        head,
        weights=None,
        loss_fn=token_loss,
        targets_spec=None,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        return_stats: bool = False,
    ):
        """Token-weighted loss of `loss_fn(head(stack(x)), targets, weights)`, pipelined.

        Blocks holding a `ParallelMoE`: with `aux_loss_coef` / `z_loss_coef`, each
        microbatch's aux losses join the loss as in `sf.parallel.accumulate`'s
        (`parallelize`'s) step: `(sum_i loss_sum_i + count_i x aux_i) / sum_i count_i`,
        `aux_i = aux_loss_coef x load_balancing_loss + z_loss_coef x router_z_loss`
        of microbatch `i`'s tokens summed over the layers (`sf.layers.moe_aux_loss`)
        and `count_i` its token weight `sum(weights[i])` (the count `token_loss`
        returns). Each stage returns its layers' aux term per microbatch next to its
        output (no side effect: the schedule's scans and remat keep it), and its
        backward takes `count_i` as that output's cotangent, so the router's
        gradients are those of this loss. Microbatch `i` is rows `i, i + m, ...` of
        the batch (see the module docstring; `accumulate` splits each shard's rows
        into contiguous blocks instead: the same definition, other microbatches).
        The layers' `MoEStats` variables are not written here: `return_stats` gives
        the step's (write them with `stack.write_stats`).

        Args:
          x: `[B, T, F]` embedded input (floating point), laid out as `io_spec`.
          targets: `[B, T]` integer targets.
          head: an `nnx.Module` mapping the stack's output (per shard, in
            `io_spec`) to logits; it runs on the last stage.
          weights: `[B, T]` token weights (default 1).
          loss_fn: `loss_fn(logits, targets, weights) -> (loss_sum, weight_sum)`
            over local tokens (default `sf.layers.token_loss`); the result is
            `sum(loss_sum) / sum(weight_sum)` over all tokens.
          targets_spec: PartitionSpec of targets/weights as the head's logits
            lay out tokens (default: the first two entries of `io_spec`).
            Mesh axes absent from it replicate the loss: only their first
            device's loss counts.

          aux_loss_coef, z_loss_coef: the MoE aux losses' coefficients (above;
            `RunOptions`'); ignored without a `ParallelMoE` in the blocks.
          return_stats: also return the blocks' `MoEStats` of this call.

        Returns:
          The scalar float32 loss; differentiable with respect to the stack,
          the head and `x`. With `return_stats`, `(loss, stats)`: `stats` the pure
          `nnx.State` of the blocks' `MoEStats`, stacked rows as the variables
          (`[L]`, `[L, E]`), each the mean over the microbatches (counts: the sum),
          as `accumulate`'s step reports them; an empty state without MoE blocks.

        Raises:
          ValueError: `x` or the head (its `in_features` or `features`) not of the
            stack's width, or a batch that does not split into the microbatches.
        """
        self._check_batch(x, targets, weights)
        check_head(head, self.stack.features, source="the stack")
        if weights is None:
            weights = jnp.ones(targets.shape, jnp.float32)
        if targets_spec is None:
            targets_spec = P(*tuple(self.io_spec)[:2])
        stack_graphdef, stack_values, specs, template = pure_without_stats(self.stack.blocks)
        head_graphdef, head_values = pure(head)
        head_specs = spec_tree(nnx.get_partition_spec(nnx.state(head)))
        aux_coefs = None
        if self.stack.has_moe and (aux_loss_coef or z_loss_coef):
            aux_coefs = (float(aux_loss_coef), float(z_loss_coef))
        config = self._config(
            stack_graphdef,
            specs,
            template,
            aux_coefs=aux_coefs,
            head_graphdef=head_graphdef,
            head_specs=head_specs,
            loss_fn=loss_fn,
            targets_spec=targets_spec,
        )
        # On the activation layout first: the reshard's transpose brings x's gradient back
        # to x's own sharding (e.g. that of an embedding lookup).
        x = place(x, self.mesh, P(*self.io_spec))
        loss, rows = pipelined_loss(config, stack_values, head_values, x, targets, weights)
        if not return_stats:
            return loss
        stats = nnx.from_flat_state(
            [(path, row) for (path, _, _), row in zip(template, rows, strict=True)]
        )
        return loss, stats

    def _config(self, graphdef, layer_specs, stats_template, **head):
        return Config(
            schedule=self.schedule,
            p=self.num_stages,
            m=self.num_microbatches,
            v=self.virtual_stages,
            mesh=self.mesh,
            pipeline_axis=self.pipeline_axis,
            io_spec=self.io_spec,
            stack_graphdef=graphdef,
            layer_specs=layer_specs,
            stats_template=stats_template,
            apply_layers=self.stack.apply_stage_layers_with_stats,
            poison=self.poison_buffers,
            residuals=self.residuals,
            **head,
        )
