"""Does DiLoCo's loss gap to all-reduce on lm-lan close over a longer run?

bench_diloco's lm-lan job runs 256 steps, four outer steps at H = 64, where DiLoCo ended 7.5%
above all-reduce in final validation loss. This runs the same job (the ``lm-lan`` scenario: 4
workers, the GPT micro on the Python standard library's text, Adam at a constant 0.004, plain
averaging as the outer step, bench_diloco's evaluation on 256 validation windows) for 1,024 steps
(16 outer steps, 0.72 of an epoch of the text), two configurations, each ``--repeats`` times (repeat k
with seed + k), one configuration's repeats after the other's:

- ``allreduce``: distrain's gradient all-reduce (bench_diloco's row of the same name);
- ``diloco-h64``: DiLoCo at H = 64 (bench_diloco's row of the same name).

Figures (fixed before the run): the median over repeats of the per-repeat ratio of diloco-h64's
final validation loss (on all the validation text) to all-reduce's, with min and max (the
issue's lm-lan target: <= 1.02); and, at every evaluation on a multiple of 256 steps (each one
right after a sync at H = 64, so that both models are whole; at the last step, the final
evaluation), the same ratio of the evaluation's loss, which shows how the gap moves with the run's
length. With a constant learning rate and a
warm-up counted in steps, a run's first 256 steps are those of bench_diloco's 256-step run.

    python benchmarks/bench_diloco_length.py              # 3 repeats, about 50 minutes on 2 cores
    python benchmarks/bench_diloco_length.py --repeats 1 --steps 128   # a quick look

Writes ``benchmarks/results/diloco_length.json``; the runs stay under
``benchmarks/results/diloco-length/`` (not committed). The figures are losses at equal tokens,
which do not depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench_diloco import CONFIGS, RESULTS, ROOT, SCENARIOS, SETTINGS, column, per_run, run_configs
from provenance import check_repeats, ratio_spread, spread, write_result

from distrain.train.metrics import read_metrics

STEPS_PER_EPOCH = 1414  # windows of 64 a step over the text (bench_diloco's SETTINGS)
LONG = 1024
EVERY = 256  # the evaluations compared along the run
RUN: list[dict] = [next(c for c in CONFIGS if c["label"] == label) for label in ("allreduce", "diloco-h64")]


def evaluations(row: dict, out: Path) -> list[dict[int, float] | None]:
    """Each repeat's evaluation losses during the run (step -> loss on the sampled windows)."""
    found = []
    for record in row.get("runs", []):
        if record.get("status") != "ok":
            found.append(None)
            continue
        found.append({m["step"]: m["test_loss"] for m in read_metrics(out / record["run_dir"])
                      if "test_loss" in m and m.get("step")})
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=LONG, help="the run's steps (a quick look: fewer)")
    parser.add_argument("--out", type=Path, default=RESULTS / "diloco_length.json")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    # steps are ceil(epochs x 1,414): a hair under the exact fraction, as bench_diloco's 0.1808
    overrides = {**SETTINGS, "epochs": round(args.steps / STEPS_PER_EPOCH - 5e-5, 4), "eval_every": 64 / STEPS_PER_EPOCH}
    out = args.out.parent / "diloco-length"
    start = time.perf_counter()
    base, comparison = run_configs("lm-lan", overrides, RUN, args.repeats, out, "benchmarks/bench_diloco_length.py")
    rows = {row["label"]: row for row in comparison["configs"]}
    runs = {label: per_run(row, out) for label, row in rows.items()}
    steps = sorted({r["steps"] for rs in runs.values() for r in rs if r is not None})
    configs = {label: {key: spread(column(rs, key)) for key in ("final_val_loss", "step_s")}
               for label, rs in runs.items()}
    final = ratio_spread(column(runs["diloco-h64"], "final_val_loss"), column(runs["allreduce"], "final_val_loss"))
    curves = {label: evaluations(row, out) for label, row in rows.items()}
    along = {}
    for step in range(EVERY, max(steps or [0]) + 1, EVERY):
        pick = {label: [None if c is None else c.get(step) for c in cs] for label, cs in curves.items()}
        along[str(step)] = {"allreduce": spread(pick["allreduce"]), "diloco-h64": spread(pick["diloco-h64"]),
                            "ratio": ratio_spread(pick["diloco-h64"], pick["allreduce"])}
    result = {"scenario_file": str(SCENARIOS["lm-lan"].relative_to(ROOT)), "repeats": args.repeats,
              "epochs": base.run.epochs, "steps": steps, "configurations": RUN, "configs": configs,
              "final_loss_diloco_over_allreduce": final, "target": "<= 1.02",
              "met": final["median"] is not None and final["median"] <= 1.02,
              "evaluation_loss_ratio_along_the_run": along, "elapsed_s": time.perf_counter() - start}
    write_result(args.out, result, argv=sys.argv)
    for step, value in along.items():
        r = value["ratio"]
        print(f"step {step}: diloco-h64 / allreduce evaluation loss: median {r['median']} "
              f"(min {r['min']}, max {r['max']})", flush=True)
    print(f"final validation loss, diloco-h64 / allreduce: median {final['median']} (min {final['min']}, "
          f"max {final['max']}); target <= 1.02: {'met' if result['met'] else 'not met'}", flush=True)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
