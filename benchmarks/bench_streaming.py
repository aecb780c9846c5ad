"""Streaming DiLoCo against plain DiLoCo on the lm-edge job: what the overlapped merge costs.

The ``lm-edge`` scenario as ``bench_diloco.py`` runs it (4 workers, the GPT micro on the Python
standard library's text, 256 steps of Adam, plain averaging as the outer step, 20 Mbit/s and
10 ms links), three configurations, each ``--repeats`` times (repeat k with seed + k), one
configuration's repeats after the other's (``distrain compare``'s order), in this order:

- ``diloco-h64``: H = 64, one fragment, no overlap (bench_diloco's row of the same name);
- ``streaming``: 4 fragments, each exchange overlapping 4 inner steps, merged with the default
  ``--merge-weight`` (1: the fragment takes the synced parameters; bench_diloco's streaming row);
- ``streaming-half``: the same with ``--merge-weight 0.5``, the streaming paper's mix of the
  synced and the worker's own fragment.

Figures (fixed before the run): for each streaming configuration, the median over repeats of the
per-repeat ratio of its final validation loss to ``diloco-h64``'s (with min and max), and the
same for the time to the scenario's target loss (a repeat that never reaches it gives no ratio),
with every run's final loss, time to target, step time and peak link use. Timing needs a quiet
machine: run nothing beside it.

    python benchmarks/bench_streaming.py               # 3 repeats, about 15 minutes
    python benchmarks/bench_streaming.py --repeats 1 --epochs 0.01   # a quick look

Writes ``benchmarks/results/diloco_streaming.json``; the runs stay under
``benchmarks/results/diloco-streaming/`` (not committed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench_diloco import CONFIGS, RESULTS, ROOT, SCENARIOS, SETTINGS, column, per_run, run_configs
from provenance import check_repeats, ratio_spread, spread, write_result

PLAIN, STREAMING = (next(c for c in CONFIGS if c["label"] == label) for label in ("diloco-h64", "diloco-h64-streaming"))
RUN: list[dict] = [{**PLAIN}, {**STREAMING, "label": "streaming"},
                   {**STREAMING, "label": "streaming-half", "merge_weight": 0.5}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=float, default=None, help="override the run's epochs (a quick look)")
    parser.add_argument("--out", type=Path, default=RESULTS / "diloco_streaming.json")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    overrides = {**SETTINGS, **({"epochs": args.epochs} if args.epochs is not None else {})}
    out = args.out.parent / "diloco-streaming"
    start = time.perf_counter()
    base, comparison = run_configs("lm-edge", overrides, RUN, args.repeats, out, "benchmarks/bench_streaming.py")
    runs = {row["label"]: per_run(row, out) for row in comparison["configs"]}
    configs = {label: {key: spread(column(rs, key)) for key in
                       ("final_val_loss", "time_to_target_s", "step_s", "peak_send_bytes_per_s")} for label, rs in runs.items()}
    plain = runs[PLAIN["label"]]
    figures = {}
    for label in ("streaming", "streaming-half"):
        figures[f"{label}_loss_over_plain"] = ratio_spread(column(runs[label], "final_val_loss"),
                                                           column(plain, "final_val_loss"))
        figures[f"{label}_time_to_target_over_plain"] = ratio_spread(column(runs[label], "time_to_target_s"),
                                                                     column(plain, "time_to_target_s"))
    result = {"scenario_file": str(SCENARIOS["lm-edge"].relative_to(ROOT)), "repeats": args.repeats,
              "epochs": base.run.epochs, "configurations": RUN, "configs": configs, **figures,
              "elapsed_s": time.perf_counter() - start}
    write_result(args.out, result, argv=sys.argv)
    for name, value in figures.items():
        median = value.get("median")
        print(f"{name}: median {median if median is None else round(median, 4)} "
              f"(min {value.get('min')}, max {value.get('max')})", flush=True)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
