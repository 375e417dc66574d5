"""Golden results of the planner search: every plan it returns, in full, for fixed problems.

Runs `sf.plan` (and, for a few problems, the exhaustive search with the branch and bound
off) over the published runs of tests/planner/test_published.py (the paper's pinned
parallelism and the free choice), the problems of tests/planner/test_search.py's
`_generated_problems` (seeds 0 and 1) and the first problems that
tests/planner/test_search_generated.py's hypothesis strategy draws (derandomized), and
writes, per problem, the `repr` of every returned plan's `Parallelism` and `Estimate`
(every term, its value and formula) or the `PlanningError`'s message, to a JSON file.
A change that must not change any result leaves that file byte-identical:

    python bench/planner_golden.py /tmp/before.json        # on the old code
    python bench/planner_golden.py /tmp/after.json         # on the new code
    cmp /tmp/before.json /tmp/after.json

`--quick` runs the few cheap problems whose results tests/planner/test_golden.py checks
against tests/planner/golden_plans.json (`--quick tests/planner/golden_plans.json`
regenerates that file, from code whose results are known good: it was written by the
search before its speed-ups, commit c9c66e3, and rewritten once since, when shardfuse's own
MoE dispatch over expert x model came to be priced as the layer runs it, every model rank
dispatching all of its tokens (`Assumptions.moe_sequence_sharded`): the Mixtral problem's
expert x model plans gave way to pipelined ones, and every plan's `Assumptions` shows the
new field; then once more for `Assumptions.ep_static_receive`, a field in every plan's
`Assumptions` and no plan changed).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.planner's generators

from shardfuse import hardware, models  # noqa: E402
from shardfuse.planner import Assumptions, PlanningError, plan, published, search  # noqa: E402

TABLE1 = {run.model: run for run in published.NARAYANAN_2021_TABLE1}
QUICK_PUBLISHED = ("gpt-1.7b", "gpt-39b", "gpt-145b")  # the paper's pins only
GENERATED_DRAWS = 12


def published_problems(names):
    """(name, model, cluster, plan keywords): the paper's pinned parallelism and the free plan."""
    for name in names:
        run = TABLE1[name]
        model = models.get(run.model)
        cluster = hardware.cluster(run.device, nodes=run.gpus // 8)
        sizes = dict(global_batch=run.global_batch, seq_len=run.seq_len,
                     assumptions=Assumptions.megatron_2021())  # fmt: skip
        mesh = dict(model=run.tensor, pipeline=run.pipeline, data=run.data, fsdp=1, sequence=1)
        yield (f"published/{name}/paper", model, cluster,
               dict(sizes, mesh=mesh, zero=0, remat="full", microbatch_size=1,
                    schedule=("1f1b", "interleaved"), top_k=1))  # fmt: skip
        yield f"published/{name}/free", model, cluster, dict(sizes, top_k=1)


def search_problems(count, seeds=(0, 1)):
    """tests/planner/test_search.py's `_generated_problems`."""
    from tests.planner.test_search import _generated_problems

    for seed in seeds:
        for i, (model, cluster, batch, seq, top_k, pinned) in enumerate(
            _generated_problems(count, seed)
        ):
            kwargs = dict(global_batch=batch, seq_len=seq, top_k=top_k, mesh=pinned)
            yield f"search/{seed}/{i}", model, cluster, kwargs


def hypothesis_problems(count, max_devices):
    """The first `count` problems tests/planner/test_search_generated.py's strategy draws
    (derandomized, and with `PYTHONHASHSEED=0`, which `main` sets: the same every run of the
    same hypothesis version)."""
    import hypothesis

    from tests.planner.test_search_generated import PALM_ON_TWO_PODS, problems

    drawn = []

    @hypothesis.settings(max_examples=count, derandomize=True, database=None, deadline=None,
                         phases=(hypothesis.Phase.generate,),
                         suppress_health_check=list(hypothesis.HealthCheck))  # fmt: skip
    @hypothesis.given(problems(max_devices))
    def draw(problem):
        drawn.append(problem)

    draw()
    for i, (model, cluster, kwargs) in enumerate([PALM_ON_TWO_PODS, *drawn[:count]]):
        yield f"generated/{max_devices}/{i}", model, cluster, kwargs


def result(model, cluster, kwargs) -> dict:
    """The plans `plan` returns, in full (or its PlanningError's message)."""
    try:
        plans = plan(model, cluster, **kwargs)
    except PlanningError as error:
        return {"error": str(error)}
    return {"plans": [[repr(p.parallelism), repr(p.estimate)] for p in plans]}


def run(problems, exhaustive=()) -> dict:
    out = {}
    for name, model, cluster, kwargs in problems:
        start = time.perf_counter()
        out[name] = dict(problem=repr((model, cluster.describe(), kwargs)),
                         **result(model, cluster, kwargs))  # fmt: skip
        if name in exhaustive:  # the branch and bound off: the same plans, all estimated
            search.BOUND = False
            try:
                out[name + "/exhaustive"] = result(model, cluster, kwargs)
            finally:
                search.BOUND = True
        print(f"{name}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return out


def moe_problems():
    """Mixtures of experts (the expert axis, its all-to-alls, an async pipeline)."""
    mixtral, qwen = models.get("mixtral-8x7b"), models.get("qwen3-30b-a3b")
    yield ("moe/mixtral", mixtral, hardware.cluster("h100", nodes=2),
           dict(global_batch=64, seq_len=4096, top_k=5))  # fmt: skip
    yield ("moe/qwen3-megatron", qwen, hardware.cluster("h100", nodes=4),
           dict(global_batch=128, seq_len=4096, top_k=3,
                assumptions=Assumptions.preset("megatron-moe")))  # fmt: skip


def quick_problems():
    """A few cheap problems (no hypothesis: pytest cannot fix the hash seed its draws need)."""
    from tests.planner.test_search_generated import PALM_ON_TWO_PODS

    for name, model, cluster, kwargs in published_problems(QUICK_PUBLISHED):
        if name.endswith("/paper"):
            yield name, model, cluster, kwargs
    yield "published/palm-540b-two-pods", *PALM_ON_TWO_PODS
    yield from (problem for problem in moe_problems() if problem[0] == "moe/mixtral")
    yield from (p for p in search_problems(4, seeds=(0,)) if p[0] in ("search/0/1", "search/0/3"))


QUICK_EXHAUSTIVE = ("search/0/1",)


def full_problems():
    yield from published_problems(TABLE1)
    yield from moe_problems()
    yield from search_problems(8)
    yield from hypothesis_problems(GENERATED_DRAWS, 512)
    yield from hypothesis_problems(GENERATED_DRAWS, 6144)


FULL_EXHAUSTIVE = ("search/0/1", "search/0/3", "search/1/1", "search/1/2")


def main():
    if os.environ.get("PYTHONHASHSEED") != "0":  # the strategy draws sets of strings
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  dict(os.environ, PYTHONHASHSEED="0"))  # fmt: skip
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--quick", action="store_true", help="the test's few cheap problems")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.quick:
        results = run(quick_problems(), QUICK_EXHAUSTIVE)
    else:
        results = run(full_problems(), FULL_EXHAUSTIVE)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"{len(results)} results in {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
