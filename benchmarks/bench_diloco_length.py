"""Does DiLoCo's loss gap to all-reduce on lm-lan close over a longer run?

bench_diloco's lm-lan job runs 256 steps, four outer steps at H = 64, where DiLoCo ended 7.5%
above all-reduce in final validation loss. This runs the same job (the ``lm-lan`` scenario: 4
workers, the GPT micro on the Python standard library's text, Adam at a constant 0.004, plain
averaging as the outer step unless a configuration says otherwise, bench_diloco's evaluation on
256 validation windows) for 1,024 steps (0.72 of an epoch of the text): all-reduce and the DiLoCo
configurations named by ``--configs``, each ``--repeats`` times (repeat k with seed + k), one
configuration's repeats after the other's:

- ``allreduce``: distrain's gradient all-reduce (bench_diloco's row of the same name), always;
- ``diloco-h64``: DiLoCo at H = 64, plain averaging (bench_diloco's row; 16 outer steps);
- ``diloco-auto``: DiLoCo with ``--sync-every auto`` (bench_diloco's row): H from the measured
  step time and the link, so that exchanges cost at most 10% of compute;
- ``diloco-h16-nesterov``: DiLoCo at H = 16 (64 outer steps) with the outer Nesterov step at lr
  0.7, momentum 0.9 (DiLoCo's published outer optimizer, distrain's default), which the scenario's
  256-step runs by hand found overshooting over a few outer steps;
- ``diloco-h4-lr0.002``: DiLoCo at H = 4 (auto's choice on this link) with plain averaging, its
  inner Adam at 0.002 (0.004 scaled by the square root of one worker's batch over the global
  batch, 16 / 64: the scenario keeps 0.004 for every optimizer step).

Figures (fixed before the run), for each DiLoCo configuration: the median over repeats of the
per-repeat ratio of its final validation loss (on all the validation text) to all-reduce's, with
min and max (the issue's lm-lan target: <= 1.02); and, at every evaluation on a multiple of 256
steps (at the last step, the final evaluation), the same ratio of the evaluation's loss, which
shows how the gap moves with the run's length. DiLoCo's evaluations are of the shared (outer)
parameters, a whole model at any step. With a constant learning rate and a warm-up counted in
steps, a run's first 256 steps are those of bench_diloco's 256-step run.

    python benchmarks/bench_diloco_length.py              # 3 repeats, about 50 minutes on 2 cores
    python benchmarks/bench_diloco_length.py --repeats 1 --steps 128   # a quick look
    python benchmarks/bench_diloco_length.py --configs diloco-auto,diloco-h16-nesterov \
        --out benchmarks/results/diloco_length_auto_nesterov.json

Writes ``benchmarks/results/diloco_length.json`` (or ``--out``); the runs stay beside it, under
``benchmarks/results/diloco-length/`` (the file's name with dashes; not committed). The figures
are losses at equal tokens, which do not depend on the machine's speed. Run from the repository's
root.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_diloco import CONFIGS, RESULTS, ROOT, SCENARIOS, SETTINGS, column, per_run, run_configs
from provenance import check_repeats, ratio_spread, spread, write_result

from distrain.train.metrics import read_metrics

STEPS_PER_EPOCH = 1414  # windows of 64 a step over the text (bench_diloco's SETTINGS)
LONG = 1024
EVERY = 256  # the evaluations compared along the run
#: DiLoCo configurations of this script's own, beside bench_diloco's
EXTRA: list[dict] = [{"label": "diloco-h16-nesterov", "algorithm": "diloco", "sync_every": 16,
                      "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9},
                     {"label": "diloco-h4-lr0.002", "algorithm": "diloco", "sync_every": 4,
                      "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0, "lr": 0.002}]
CHOICES = {c["label"]: c for c in [*CONFIGS, *EXTRA] if c.get("algorithm") == "diloco"}


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
    parser.add_argument("--configs", default="diloco-h64",
                        help=f"comma-separated DiLoCo configurations beside all-reduce: {', '.join(CHOICES)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "diloco_length.json")
    parser.add_argument("--figures-only", action="store_true",
                        help="the figures again from the runs beside --out (comparison.json), without running any; "
                             "a configuration whose runs are not all there (a run stopped early) is left out, "
                             "and the result says so")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    chosen = [label for label in args.configs.split(",") if label]
    if not chosen or set(chosen) - set(CHOICES) or len(set(chosen)) != len(chosen):
        parser.error(f"--configs: choose among {', '.join(CHOICES)}, each once, got {args.configs!r}")
    run = [next(c for c in CONFIGS if c["label"] == "allreduce"), *(CHOICES[label] for label in chosen)]
    # steps are ceil(epochs x 1,414): a hair under the exact fraction, as bench_diloco's 0.1808
    overrides = {**SETTINGS, "epochs": round(args.steps / STEPS_PER_EPOCH - 5e-5, 4), "eval_every": 64 / STEPS_PER_EPOCH}
    out = args.out.parent / args.out.stem.replace("_", "-")  # the runs, beside the result file
    start = time.perf_counter()
    if args.figures_only:
        comparison = json.loads((out / "comparison.json").read_text())
        epochs = comparison["settings"]["run"]["epochs"] if "run" in comparison.get("settings", {}) else overrides["epochs"]
    else:
        base, comparison = run_configs("lm-lan", overrides, run, args.repeats, out, "benchmarks/bench_diloco_length.py")
        epochs = base.run.epochs
    rows = {row["label"]: row for row in comparison["configs"]
            if sum(r.get("status") == "ok" for r in row.get("runs", [])) == args.repeats}
    missing = [label for label in chosen if label not in rows]
    chosen = [label for label in chosen if label in rows]
    if "allreduce" not in rows:
        parser.error(f"--figures-only: no complete all-reduce runs in {out}")
    runs = {label: per_run(row, out) for label, row in rows.items()}
    steps = sorted({r["steps"] for rs in runs.values() for r in rs if r is not None})
    configs = {label: {key: spread(column(rs, key)) for key in ("final_val_loss", "step_s")}
               for label, rs in runs.items()}
    final = {label: ratio_spread(column(runs[label], "final_val_loss"), column(runs["allreduce"], "final_val_loss"))
             for label in chosen}
    curves = {label: evaluations(row, out) for label, row in rows.items()}
    along = {}
    for step in range(EVERY, max(steps or [0]) + 1, EVERY):
        pick = {label: [None if c is None else c.get(step) for c in cs] for label, cs in curves.items()}
        along[str(step)] = {**{label: spread(values) for label, values in pick.items()},
                            "ratio": {label: ratio_spread(pick[label], pick["allreduce"]) for label in chosen}}
    met = {label: f["median"] is not None and f["median"] <= 1.02 for label, f in final.items()}
    result = {"scenario_file": str(SCENARIOS["lm-lan"].relative_to(ROOT)), "repeats": args.repeats,
              "epochs": epochs, "steps": steps, "configurations": run, "configs": configs,
              "not_complete": missing,
              **({"runs_from": {k: comparison.get(k) for k in ("created", "command", "machine")}}
                 if args.figures_only else {}),
              "final_loss_over_allreduce": final, "target": "<= 1.02", "met": met,
              "evaluation_loss_ratio_along_the_run": along, "elapsed_s": time.perf_counter() - start}
    write_result(args.out, result, argv=sys.argv)
    for label in missing:
        print(f"{label}: not all {args.repeats} repeats ran; left out", flush=True)
    for label in chosen:
        for step, value in along.items():
            r = value["ratio"][label]
            print(f"step {step}: {label} / allreduce evaluation loss: median {r['median']} "
                  f"(min {r['min']}, max {r['max']})", flush=True)
        f = final[label]
        print(f"final validation loss, {label} / allreduce: median {f['median']} (min {f['min']}, "
              f"max {f['max']}); target <= 1.02: {'met' if met[label] else 'not met'}", flush=True)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
