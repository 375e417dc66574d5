"""`RunOptions`' mixture-of-experts options (issue 44): checked once, where the run's choices live.

`sf.layers.LayerOptions` has no MoE fields: the MoE layers and the losses read
`capacity_factor`, `aux_loss_coef` and `z_loss_coef` from the run's options
(should `LayerOptions` gain them at the merge, `layer_options()` hands them on).
"""

import doctest
import math

import pytest

from shardfuse.parallel import RunOptions
from shardfuse.parallel import options as options_module


def test_defaults_dropless_switch_aux_loss_no_z_loss():
    options = RunOptions()
    assert options.capacity_factor is None
    assert options.aux_loss_coef == 0.01 and options.z_loss_coef == 0.0


def test_valid_values_are_kept_and_replace_checks_again():
    options = RunOptions(capacity_factor=1.25, aux_loss_coef=0.001, z_loss_coef=1e-3)
    assert (options.capacity_factor, options.aux_loss_coef, options.z_loss_coef) == (
        1.25, 0.001, 1e-3,
    )  # fmt: skip
    assert RunOptions(capacity_factor=2, aux_loss_coef=0).capacity_factor == 2
    with pytest.raises(ValueError, match="capacity_factor=-1"):
        options.replace(capacity_factor=-1)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(capacity_factor=0), "capacity_factor=0 must be None \\(dropless\\) or a number > 0"),
        (dict(capacity_factor=-0.5), "capacity_factor=-0.5"),
        (dict(capacity_factor=math.inf), "capacity_factor=inf"),
        (dict(capacity_factor=math.nan), "capacity_factor=nan"),
        (dict(capacity_factor=True), "capacity_factor=True"),
        (dict(capacity_factor="1.25"), "capacity_factor='1.25'"),
        (dict(aux_loss_coef=-0.01), "aux_loss_coef=-0.01 must be a number >= 0"),
        (dict(aux_loss_coef=None), "aux_loss_coef=None"),
        (dict(z_loss_coef=-1e-3), "z_loss_coef=-0.001 must be a number >= 0"),
        (dict(z_loss_coef=math.nan), "z_loss_coef=nan"),
        (dict(dispatch_chunks=0), "dispatch_chunks=0 must be an int >= 1"),
        (dict(dispatch_chunks=2.0), "dispatch_chunks=2.0"),
        (dict(dispatch_chunks=True), "dispatch_chunks=True"),
    ],
)
def test_bad_values_name_the_option(fields, match):
    with pytest.raises(ValueError, match=match):
        RunOptions(**fields)


def test_layer_options_still_derive_with_moe_options_set():
    run = RunOptions(zero=0, remat="full", capacity_factor=1.0, z_loss_coef=1e-3)
    layer = run.layer_options()
    assert (layer.zero, layer.remat) == (0, "full")


def test_docstring_examples_run():
    assert doctest.testmod(options_module).failed == 0


def test_dispatch_chunks_reach_every_moe_layer():
    """`RunOptions(dispatch_chunks=2)` -> `parallelize` -> the model's `ParallelMoE`s."""
    import jax
    from flax import nnx

    import shardfuse as sf
    from shardfuse.models import ModelSpec

    spec = ModelSpec.tiny(num_layers=2, experts=4, top_k=2)
    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    assert RunOptions().dispatch_chunks == 1
    for chunks in (1, 3):
        model = sf.parallel.parallelize(spec, RunOptions(dispatch_chunks=chunks), mesh).model
        layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, sf.layers.ParallelMoE)]
        assert layers and {layer.dispatch_chunks for layer in layers} == {chunks}
