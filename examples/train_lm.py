"""Train a Llama-style LM with shardfuse on any mesh over pipeline, data, fsdp, sequence, model.

Single host (8 CPU devices):
  JAX_NUM_CPU_DEVICES=8 python examples/train_lm.py --mesh data=2,sequence=2,model=2 --steps 20

A mixture of experts, 8 experts over an expert axis of 4 (each step prints the
load-balancing aux loss, the router z-loss and the expert load, max/mean tokens):
  python examples/train_lm.py --mesh expert=4,data=2 --experts 8 --top-k 2 \
      [--shared-experts 1] [--capacity-factor 1.25] [--expert-hidden 64] [--dispatch-chunks 2]

Several processes (one per host on a cluster; here two local ones on loopback):
  python examples/launch_local.py --num-processes 2 --devices-per-process 4 -- \\
      python examples/train_lm.py --mesh data=2,model=4 --steps 5

Each process calls `jax.distributed.initialize` (from --coordinator/--num-processes/
--process-id or the JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID
environment variables), loads only its rows of every batch, and process 0 prints
and writes the JSON log; orbax coordinates the checkpoint writes.
"""

import json
import os
import sys


def make_parser():
    """The options; a bad one ends the program with one line `...: error: ...`, status 2."""
    # (imported here: JAX reads JAX_NUM_CPU_DEVICES when it is first imported)
    from shardfuse.cli import ArgumentParser, non_negative_int, positive_int

    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--mesh", default="data=2,sequence=2,model=2", help="AXIS=SIZE,... (default %(default)s)"
    )
    p.add_argument(
        "--plan", action="store_true", help="take the mesh and options from sf.plan (not --mesh)"
    )
    p.add_argument("--steps", type=non_negative_int, default=20)
    p.add_argument("--batch", type=positive_int, default=8, help="global batch (sequences)")
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--features", type=positive_int, default=64)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, default=2)
    p.add_argument("--hidden", type=positive_int, default=128)
    p.add_argument("--vocab", type=positive_int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--experts", type=non_negative_int, default=0, help="routed experts (0: a dense model)"
    )
    p.add_argument("--top-k", type=positive_int, default=2, help="experts per token")
    p.add_argument(
        "--expert-hidden", type=positive_int, default=None, help="an expert's width (--hidden)"
    )
    p.add_argument("--shared-experts", type=non_negative_int, default=0)
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="each expert's capacity (default: dropless); dropped tokens are counted",
    )
    p.add_argument(
        "--dispatch-chunks",
        type=positive_int,
        default=1,
        help="expert parallelism: dispatch the routed rows in this many chunks, overlapped "
        "with the expert compute where collectives are asynchronous (GPU, TPU)",
    )
    p.add_argument("--aux-loss-coef", type=float, default=0.01, help="load-balancing loss")
    p.add_argument("--z-loss-coef", type=float, default=0.0, help="router z-loss")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (fsdp)")
    p.add_argument(
        "--remat",
        default="none",
        choices=("none", "full", "selective", "dots", "offload"),
        help="activation checkpointing policy of each layer",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="ZeRO-3: gather each layer's weights while the layer before it computes",
    )
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=1,
        help="gradient accumulation microbatches; pipeline microbatches with a pipeline axis",
    )
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved", "zb-h1"))
    p.add_argument(
        "--virtual-stages", type=positive_int, default=1, help="interleaved: chunks per stage"
    )
    p.add_argument("--data", choices=("synthetic", "text"), default="synthetic")
    p.add_argument("--text-file", default=None, help="UTF-8 text (default: the shipped corpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="save here; resume from here if present")
    p.add_argument("--checkpoint-every", type=positive_int, default=10)
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from this Hugging Face checkpoint (its architecture replaces the size flags)",
    )
    p.add_argument(
        "--export-hf", default=None, metavar="DIR", help="after training, save the model here (HF)"
    )
    p.add_argument("--log-json", default=None)
    p.add_argument("--device", default=None, help="sf.hardware chip for the MFU estimate")
    p.add_argument(
        "--spread-processes",
        action="store_true",
        help="arrange devices so every mesh axis crosses processes (for testing)",
    )
    p.add_argument("--coordinator", default=None, help="host:port of process 0")
    p.add_argument("--num-processes", type=positive_int, default=None)
    p.add_argument("--process-id", type=non_negative_int, default=None)
    return p


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        trainer = setup(args)
    except (ValueError, TypeError, OSError) as error:  # the library's checks of the arguments
        parser.error(str(error))
    losses = trainer.run()
    from shardfuse.parallel import distributed

    if losses and distributed.is_primary():
        print(json.dumps({"first_loss": losses[0], "last_loss": losses[-1]}), flush=True)
    return 0


def setup(args):
    """The `Trainer` the arguments describe (ValueError when they do not fit together)."""
    from shardfuse.parallel import distributed  # before any backend starts

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from shardfuse.models import ModelSpec
    from shardfuse.parallel import RunOptions
    from shardfuse.train import TrainConfig, Trainer, parse_mesh

    moe = {}
    if args.experts:  # a mixture of experts in every block
        moe = dict(experts=args.experts, top_k=args.top_k, shared_experts=args.shared_experts,
                   expert_hidden=args.expert_hidden)  # fmt: skip
    elif (
        args.shared_experts
        or args.capacity_factor is not None
        or args.expert_hidden
        or args.dispatch_chunks != 1
    ):
        raise ValueError(
            "--shared-experts, --expert-hidden, --capacity-factor and --dispatch-chunks need "
            "--experts > 0"
        )
    model = ModelSpec.tiny(
        "train_lm",
        vocab_size=args.vocab,
        hidden=args.features,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn_hidden=args.hidden,
        num_layers=args.layers,
        **moe,
    )
    config = TrainConfig(
        mesh=parse_mesh(args.mesh),
        model=model,
        steps=args.steps,
        global_batch=args.batch,
        seq_len=args.seq_len,
        learning_rate=args.lr,
        data=args.data,
        text_file=args.text_file,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        log_json=args.log_json,
        device=args.device,
        spread_processes=args.spread_processes,
        options=RunOptions(
            zero=args.zero,
            remat=args.remat,
            prefetch=args.prefetch,
            num_microbatches=args.microbatches,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
            capacity_factor=args.capacity_factor,
            dispatch_chunks=args.dispatch_chunks,
            aux_loss_coef=args.aux_loss_coef,
            z_loss_coef=args.z_loss_coef,
        ),
        init_from=args.init_from,
        export_hf=args.export_hf,
    )
    if args.plan:
        import jax

        from shardfuse.train import planned

        config, best = planned(config, jax.device_count())
        if distributed.is_primary():
            print(f"plan: {best.summary()}", flush=True)
    return Trainer(config, log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    sys.exit(main())
