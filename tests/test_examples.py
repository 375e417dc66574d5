"""The tiny LM example trains on a 2x2x2 mesh and its loss goes down."""

from shardfuse.demos.tiny_lm import train


def test_tiny_lm_loss_goes_down():
    losses = train(steps=8, layers=1, log=lambda line: None)
    assert all(loss == loss for loss in losses)  # no NaN
    assert losses[-1] < 0.9 * losses[0], losses
