"""Demo section: a small training run (`shardfuse.train.Trainer`, as examples/train_lm.py runs)."""

from shardfuse.model_spec import ModelSpec
from shardfuse.train import TrainConfig, Trainer


def rows(seq_len: int = 512):
    """Demo section: a small run of `examples/train_lm.py` on 2x2x2 (data, sequence, model).

    `seconds` is the median step time after the first step; `compile_seconds`
    the first step (compilation included). `seq_len` is unused (own sizes).
    """
    del seq_len
    config = TrainConfig(
        model=ModelSpec.tiny(vocab_size=64, num_layers=2),
        steps=20,
        global_batch=8,
        seq_len=64,
    )
    trainer = Trainer(config, log=lambda line: print(f"  train_lm {line}", flush=True))
    losses = trainer.run()
    times = [record["step_time_s"] for record in trainer.history]
    return [
        dict(
            op="Llama-style LM training (examples/train_lm.py)",
            implementation="layers on data 2 x sequence 2 x model 2",
            case=f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps",
            shape="B8 T64 F64 H4 K2, 2 blocks",
            error=None,
            seconds=sorted(times[1:])[len(times[1:]) // 2],
            compile_seconds=times[0],
        )
    ]
