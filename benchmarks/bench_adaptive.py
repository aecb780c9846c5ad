"""Adaptive compression on the `fluctuating` network: time to target accuracy against fixed group top-k.

The scenario: 4 workers whose links alternate 2 s at 50 Mbit/s and 2 s at 5 Mbit/s with shifted
phases (``benchmarks/traces/fluctuating-4.csv``, 5 ms latency), a ~1M-parameter MLP
(``--model mlp --model-width 974``: 999,334 parameters) on MNIST-1D, all-reduce over the sparse
ring (``--sparse-collective ring``, where each worker's k counts) with error feedback.
The job runs 10 epochs (620 steps), long enough for the learning-rate schedule to bring every
configuration to its plateau (after 3 epochs the MLP is at ~66% and still climbing, so any byte
saved shows as accuracy lost; after 10 it is at ~85%). Configurations, run alternately (one
repeat of each, then the next):

* ``fixed``: ``group_topk`` at the base ratio (0.01);
* ``adaptive``: the default policy, ``ratio = clip(base * f(I) / g(C), min, max)`` with no
  budget (``budget=0``) and ``g(C) = sqrt(C)`` (``beta=0.5``): a congested link sends less;
* ``importance``: the same with ``beta=0`` (importance only);
* ``network``: the same with ``alpha=0`` (network only);
* not run unless named in ``--configs``: ``budget`` (``budget=1``, ``beta=1``: the signals move
  the base ratio's bytes between workers and batches), ``absolute`` (no budget,
  ``g(C) = C``), ``fixed0037`` (a fixed ratio at the adaptive policy's mean ratio, to tell the
  policy's gain from merely sending less).

Per configuration: median over repeats of the time to the target accuracy (training wall time,
evaluation excluded, first evaluation at or above the target), of the final accuracy (same
epochs for all), of wall time and of bytes sent per worker per step. The figure of merit is the
median over repeats (3 by default) of the per-repeat ratio time to target of ``fixed`` / time of
``adaptive``, with its minimum and maximum (``speedup_per_repeat``; the aim: >= 1.4), with the
final accuracy within 0.5 point.

    python benchmarks/bench_adaptive.py                     # the acceptance run (~35 min)
    python benchmarks/bench_adaptive.py --repeats 1 --epochs 3 --target 0.45 --configs fixed,adaptive

Writes ``benchmarks/results/adaptive.json`` and PNGs under ``benchmarks/results/adaptive/``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from provenance import check_repeats, ratio_spread, relative, write_result

from distrain.config import TrainConfig
from distrain.launch import launch_local
from distrain.report.plots import make_plots
from distrain.report.runs import group_by_label, load_run

HERE = Path(__file__).parent
RESULTS = HERE / "results"
TRACE = HERE / "traces" / "fluctuating-4.csv"

BASE = "base=0.01:min=0.001:max=0.1"
CONFIGS: dict[str, str] = {
    "fixed": "group_topk:0.01:group=1024",
    "adaptive": f"adaptive:{BASE}:beta=0.5:budget=0",
    "importance": f"adaptive:{BASE}:beta=0:budget=0",
    "network": f"adaptive:{BASE}:beta=0.5:budget=0:alpha=0",
    # not in the default set
    "budget": f"adaptive:{BASE}:beta=1:budget=1",
    "absolute": f"adaptive:{BASE}:beta=1:budget=0",
    "fixed0037": "group_topk:0.0037:group=1024",
}
DEFAULT_CONFIGS = "fixed,adaptive,importance,network"
#: Configurations every repeat runs; the others (the ablation) run in the first ``--ablation-repeats``.
MAIN = ("fixed", "adaptive")

JOB: dict[str, Any] = {
    "workers": 4, "dataset": "mnist1d", "model": "mlp", "model_width": 974, "algorithm": "allreduce",
    "network": "fluctuating", "bandwidth_trace": str(TRACE), "sparse_collective": "ring", "progress": False,
}


def run_once(name: str, repeat: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    run_dir = tmp / f"{name}-{repeat}"
    settings = {**JOB, "compress": CONFIGS[name], "epochs": args.epochs, "eval_every": args.eval_every,
                "target_accuracy": args.target, "seed": args.seed, "run_dir": str(run_dir)}
    cfg = TrainConfig.from_dict(settings).validate()
    started = time.time()
    summary = launch_local(cfg)
    run = load_run(run_dir, label=name)
    evals = run.evals()
    steps = summary["steps"]
    ratios = [m["compress_ratio"] for lines in run.metrics.values() for m in lines if "compress_ratio" in m]
    return {
        "config": name, "repeat": repeat, "compress": CONFIGS[name], "run_dir": str(run_dir),
        "final_test_accuracy": summary["final_test_accuracy"], "time_to_target_s": summary["time_to_target_s"],
        "wall_time_s": summary["wall_time_s"], "steps": steps,
        "bytes_per_worker_per_step": statistics.mean(b / steps for b in summary["bytes_sent_per_worker"]),
        "mean_ratio": statistics.mean(ratios) if ratios else None,
        "accuracy_vs_time": [(round(float(m["time"]), 3), float(m["test_accuracy"])) for m in evals],
        "load_before": os.getloadavg(), "started": started,
    }


def median_or_none(values: list[float | None]) -> float | None:
    """Median of the values; None when any is missing (a repeat that never reached the target)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)  # type: ignore[arg-type]


#: Besides the target: times to these accuracies too, read from the evaluation curves.
LEVELS = (0.50, 0.60, 0.70, 0.75, 0.80, 0.84)


def time_to(curve: list[tuple[float, float]], level: float) -> float | None:
    return next((t for t, a in curve if a >= level), None)


def summarize(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        out[name] = {
            "name": name,
            "median_time_to_level_s": {f"{level:.2f}": median_or_none([time_to(r["accuracy_vs_time"], level) for r in mine])
                                       for level in LEVELS},
            "compress": CONFIGS[name],
            "median_time_to_target_s": median_or_none([r["time_to_target_s"] for r in mine]),
            "median_final_test_accuracy": statistics.median(r["final_test_accuracy"] for r in mine),
            "median_wall_time_s": statistics.median(r["wall_time_s"] for r in mine),
            "median_bytes_per_worker_per_step": statistics.median(r["bytes_per_worker_per_step"] for r in mine),
            "mean_ratio": statistics.median(r["mean_ratio"] for r in mine if r["mean_ratio"] is not None),
            "times_to_target_s": [r["time_to_target_s"] for r in mine],
            "final_test_accuracies": [r["final_test_accuracy"] for r in mine],
        }
    fixed = out.get("fixed")
    for row in out.values() if fixed is not None else []:
        t_fixed, t_mine = fixed["median_time_to_target_s"], row["median_time_to_target_s"]
        row["speedup_time_to_target"] = t_fixed / t_mine if t_fixed and t_mine else None
        fixed_by_repeat = {r["repeat"]: r["time_to_target_s"] for r in runs if r["config"] == "fixed"}
        mine = [r for r in runs if r["config"] == row["name"] and r["repeat"] in fixed_by_repeat]
        row["speedup_per_repeat"] = ratio_spread([fixed_by_repeat[r["repeat"]] for r in mine],
                                                 [r["time_to_target_s"] for r in mine])
        row["speedup_wall_time"] = fixed["median_wall_time_s"] / row["median_wall_time_s"]
        row["accuracy_gap_points"] = 100 * (row["median_final_test_accuracy"] - fixed["median_final_test_accuracy"])
        row["speedup_at_level"] = {
            level: (fixed["median_time_to_level_s"][level] / t if t and fixed["median_time_to_level_s"][level] else None)
            for level, t in row["median_time_to_level_s"].items()}
    return out


def print_table(summary: dict[str, Any], target: float) -> None:
    print(f"\n  target accuracy {target:.0%}; medians over repeats")
    print(f"  {'config':<12}{'to target':>11}{'speed-up':>10}{'final acc':>11}{'gap (pt)':>10}"
          f"{'wall':>9}{'bytes/step':>12}{'mean ratio':>12}")
    for name, r in summary.items():
        ttt = f"{r['median_time_to_target_s']:.1f}s" if r["median_time_to_target_s"] else "-"
        speed = f"{r['speedup_time_to_target']:.2f}x" if r.get("speedup_time_to_target") else "-"
        print(f"  {name:<12}{ttt:>11}{speed:>10}{r['median_final_test_accuracy']:>11.4f}"
              f"{r.get('accuracy_gap_points', 0.0):>+10.2f}{r['median_wall_time_s']:>8.1f}s"
              f"{r['median_bytes_per_worker_per_step']:>12,.0f}{r['mean_ratio']:>12.4f}")
    print("  speed-up in median time to other accuracies (fixed / config):")
    for name, r in summary.items():
        cells = [f"{level}: {v:.2f}x" if v else f"{level}: -" for level, v in r.get("speedup_at_level", {}).items()]
        print(f"    {name:<12}" + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ablation-repeats", type=int, default=None,
                        help=f"repeats of the configurations other than {', '.join(MAIN)} (default: --repeats)")
    parser.add_argument("--epochs", type=float, default=10.0)
    parser.add_argument("--eval-every", type=float, default=0.25, help="epochs between evaluations")
    parser.add_argument("--target", type=float, default=0.80, help="target test accuracy (0..1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "adaptive.json"))
    parser.add_argument("--plots", default=str(RESULTS / "adaptive"), help="directory for the PNGs")
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    check_repeats(parser, args.repeats)

    runs: list[dict[str, Any]] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_adaptive-") as tmp:
        for repeat in range(args.repeats):  # alternate: one repeat of every configuration, then the next
            for name in names:
                if name not in MAIN and args.ablation_repeats is not None and repeat >= args.ablation_repeats:
                    continue
                row = run_once(name, repeat, args, Path(tmp))
                runs.append(row)
                ttt = f"{row['time_to_target_s']:.1f}s" if row["time_to_target_s"] else "not reached"
                print(f"[{time.time() - t0:6.0f}s] {name:<11} repeat {repeat}: to target {ttt}, final "
                      f"{row['final_test_accuracy']:.4f}, wall {row['wall_time_s']:.1f}s, "
                      f"{row['bytes_per_worker_per_step']:,.0f} B/step, load {row['load_before'][0]:.2f}", flush=True)
        summary = summarize(runs, names)
        print_table(summary, args.target)
        first = [load_run(Path(tmp) / f"{n}-0", label=f"{n}: {CONFIGS[n]}") for n in names]
        plots = make_plots(group_by_label(first), args.plots)
    result = {
        "scenario": {**{k: v for k, v in JOB.items() if k != "bandwidth_trace"},
                     "bandwidth_trace": relative(TRACE), "epochs": args.epochs,
                     "eval_every": args.eval_every, "target_accuracy": args.target, "repeats": args.repeats,
                     "ablation_repeats": args.ablation_repeats},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "load_after": os.getloadavg()},
        "total_seconds": time.time() - t0,
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "run_dir"} for r in runs],
        "plots": [relative(p) for p in plots],
    }
    print(f"wrote {write_result(args.out, result)} and {len(plots)} plots in {args.plots}")


if __name__ == "__main__":
    main()
