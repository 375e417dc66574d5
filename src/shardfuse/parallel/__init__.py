"""Whole-model parallelism over NNX models built from `shardfuse.layers`.

Pipeline schedules, ZeRO/FSDP, gradient accumulation, checkpointing and
multi-host helpers. Data flows one way: planner -> parallel -> layers; this
package composes layers into models and training steps and knows nothing of
kernels.
"""
