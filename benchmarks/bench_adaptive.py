"""Adaptive compression on the `fluctuating` network: time to accuracy and accuracy per byte against fixed group top-k.

The scenario: 4 workers whose links alternate 2 s at 50 Mbit/s and 2 s at 5 Mbit/s with shifted
phases (``benchmarks/traces/fluctuating-4.csv``, 5 ms latency), a ~1M-parameter MLP
(``--model mlp --model-width 974``: 999,334 parameters) on MNIST-1D, all-reduce over the sparse
ring (``--sparse-collective ring``, where each worker's k counts) with error feedback and
momentum correction, no density warm-up, 10 epochs (620 steps). Configurations, run
alternately (one repeat of each, then the next):

* ``fixed``: ``group_topk`` at the base ratio (0.01), its default groups (as adaptive's);
* ``adaptive``: the default policy, ``adaptive:base=0.01:min=0.001:max=0.1`` (network signal,
  ``beta=0.5``, spare bandwidth, importance off);
* ``importance``: the same with the importance signal on (``alpha=1``): the ablation;
* ``beta1``: the same with ``beta=1`` (bytes in proportion to the link's speed: a harder response).

The statistics, fixed before the runs:

* **time to 95%**: the target is 95% of fixed's final test accuracy (the median over its
  repeats); per repeat, fixed's time to the target over the configuration's (training wall time,
  evaluation excluded, first evaluation at or above the target); the figure is the median of
  these per-repeat ratios over the repeats, with their minimum and maximum
  (``speedup_per_repeat``; the aim for ``adaptive``: >= 1.67);
* **accuracy at equal bytes**: per repeat, the configuration's final test accuracy minus fixed's
  accuracy when fixed had sent as many bytes (rank 0's bytes at each evaluation, linearly
  interpolated; fixed's final accuracy if the configuration sent more); median, min and max over
  repeats (``gap_at_equal_bytes_points``; the aim: >= 0). ``importance`` is also compared with
  ``adaptive`` the same way (does the importance signal help at equal bytes?).

    python benchmarks/bench_adaptive.py                     # the acceptance run (~45 min)
    python benchmarks/bench_adaptive.py --repeats 1 --epochs 3 --configs fixed,adaptive

Writes ``benchmarks/results/adaptive.json`` and PNGs under ``benchmarks/results/adaptive/``.
"""

from __future__ import annotations

import argparse
import itertools
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
    "fixed": "group_topk:0.01",
    "adaptive": f"adaptive:{BASE}",
    "importance": f"adaptive:{BASE}:alpha=1",
    "beta1": f"adaptive:{BASE}:beta=1",
}
DEFAULT_CONFIGS = "fixed,adaptive,importance,beta1"
#: Configurations every repeat runs; the others (the ablation) run in the first ``--ablation-repeats``.
MAIN = ("fixed", "adaptive")
#: The target: this fraction of fixed's final test accuracy (median over its repeats).
LEVEL = 0.95

JOB: dict[str, Any] = {
    "workers": 4, "dataset": "mnist1d", "model": "mlp", "model_width": 974, "algorithm": "allreduce",
    "network": "fluctuating", "bandwidth_trace": str(TRACE), "sparse_collective": "ring", "progress": False,
    # no density warm-up: a dense epoch of this model at 5 Mbit/s would take most of the run
    "density_warmup_epochs": 0.0, "density_decay_epochs": 0.0,
}


def run_once(name: str, repeat: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    run_dir = tmp / f"{name}-{repeat}"
    settings = {**JOB, "compress": CONFIGS[name], "epochs": args.epochs, "eval_every": args.eval_every,
                "seed": args.seed, "run_dir": str(run_dir)}
    cfg = TrainConfig.from_dict(settings).validate()
    started = time.time()
    summary = launch_local(cfg)
    run = load_run(run_dir, label=name)
    evals = run.evals()
    steps = summary["steps"]
    ratios = [m["compress_ratio"] for lines in run.metrics.values() for m in lines if "compress_ratio" in m]
    by_epoch: dict[int, list[float]] = {}
    for lines in run.metrics.values():
        for m in lines:
            if "importance" in m and "step" in m:
                by_epoch.setdefault(min(int(m["epoch"] - 1e-9), int(args.epochs) - 1), []).append(m["importance"])
    return {
        "config": name, "repeat": repeat, "compress": CONFIGS[name], "run_dir": str(run_dir),
        "final_test_accuracy": summary["final_test_accuracy"],
        "wall_time_s": summary["wall_time_s"], "steps": steps,
        "bytes_per_worker_per_step": statistics.mean(b / steps for b in summary["bytes_sent_per_worker"]),
        "mean_ratio": statistics.mean(ratios) if ratios else None,
        # the importance signal's mean per epoch, over every worker's steps: centred means ~1 throughout
        "importance_by_epoch": [statistics.mean(by_epoch[e]) for e in sorted(by_epoch)],
        "accuracy_vs_time": [(round(float(m["time"]), 3), float(m["test_accuracy"])) for m in evals],
        "accuracy_vs_bytes": [(int(m["bytes_sent"]), float(m["test_accuracy"])) for m in evals],
        "load_before": os.getloadavg(), "started": started,
    }


def median_or_none(values: list[float | None]) -> float | None:
    """Median of the values; None when any is missing (a repeat that never reached the target)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)  # type: ignore[arg-type]


#: Besides the target: times to these fractions of fixed's final accuracy too.
LEVELS = (0.80, 0.90, 0.95, 0.98)


def time_to(curve: list[tuple[float, float]], level: float) -> float | None:
    return next((t for t, a in curve if a >= level), None)


def accuracy_at(curve: list[tuple[int, float]], nbytes: float) -> float:
    """Test accuracy when ``nbytes`` had been sent: linear between evaluations; the last one's
    past the end, the first one's before it."""
    if nbytes >= curve[-1][0]:
        return curve[-1][1]
    if nbytes <= curve[0][0]:
        return curve[0][1]
    for (b0, a0), (b1, a1) in itertools.pairwise(curve):
        if b0 <= nbytes <= b1:
            return a0 + (a1 - a0) * (nbytes - b0) / (b1 - b0) if b1 > b0 else a1
    return curve[-1][1]


def gap_at_equal_bytes(mine: dict[str, Any], reference: dict[str, Any]) -> float:
    """Points: ``mine``'s final accuracy minus ``reference``'s when it had sent as many bytes."""
    sent = mine["accuracy_vs_bytes"][-1][0]
    return 100 * (mine["final_test_accuracy"] - accuracy_at(reference["accuracy_vs_bytes"], sent))


def spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} if values else None


def summarize(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    fixed_runs = {r["repeat"]: r for r in runs if r["config"] == "fixed"}
    target = LEVEL * statistics.median(r["final_test_accuracy"] for r in fixed_runs.values())
    levels = {f"{lv:.2f}": lv * target / LEVEL for lv in LEVELS}
    out: dict[str, Any] = {"target_accuracy": target, "level": LEVEL}
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        times = [time_to(r["accuracy_vs_time"], target) for r in mine]
        row = {
            "compress": CONFIGS[name],
            "times_to_target_s": times,
            "median_time_to_target_s": median_or_none(times),
            "median_time_to_level_s": {k: median_or_none([time_to(r["accuracy_vs_time"], acc) for r in mine])
                                       for k, acc in levels.items()},
            "final_test_accuracies": [r["final_test_accuracy"] for r in mine],
            "median_final_test_accuracy": statistics.median(r["final_test_accuracy"] for r in mine),
            "median_wall_time_s": statistics.median(r["wall_time_s"] for r in mine),
            "median_bytes_per_worker_per_step": statistics.median(r["bytes_per_worker_per_step"] for r in mine),
            "mean_ratio": statistics.median(r["mean_ratio"] for r in mine if r["mean_ratio"] is not None),
            "importance_by_epoch": [statistics.median(vals) for vals in zip(*(r["importance_by_epoch"] for r in mine), strict=False)]
            if all(r["importance_by_epoch"] for r in mine) else None,
        }
        paired = [(fixed_runs[r["repeat"]], r) for r in mine if r["repeat"] in fixed_runs]
        ratios = [(time_to(f["accuracy_vs_time"], target), time_to(r["accuracy_vs_time"], target)) for f, r in paired]
        row["speedup_per_repeat"] = ratio_spread([a for a, _ in ratios], [b for _, b in ratios]) if paired else None
        row["gap_at_equal_bytes_points"] = spread([gap_at_equal_bytes(r, f) for f, r in paired])
        row["final_gap_points"] = spread([100 * (r["final_test_accuracy"] - f["final_test_accuracy"]) for f, r in paired])
        out[name] = row
    adaptive_runs = {r["repeat"]: r for r in runs if r["config"] == "adaptive"}
    if "importance" in out and adaptive_runs:
        out["importance"]["gap_to_adaptive_at_equal_bytes_points"] = spread(
            [gap_at_equal_bytes(r, adaptive_runs[r["repeat"]]) for r in runs
             if r["config"] == "importance" and r["repeat"] in adaptive_runs])
    return out


def print_table(summary: dict[str, Any]) -> None:
    print(f"\n  target: {summary['target_accuracy']:.4f} ({LEVEL:.0%} of fixed's final accuracy); medians over repeats")
    print(f"  {'config':<12}{'to target':>11}{'speed-up (min-max)':>22}{'final acc':>11}{'gap@bytes (pt)':>16}"
          f"{'wall':>9}{'bytes/step':>12}{'mean ratio':>12}")
    for name, r in summary.items():
        if not isinstance(r, dict):
            continue
        ttt = f"{r['median_time_to_target_s']:.1f}s" if r["median_time_to_target_s"] else "-"
        sp = r.get("speedup_per_repeat") or {}
        speed = (f"{sp['median']:.2f}x ({sp['min']:.2f}-{sp['max']:.2f})" if sp.get("median") else "-")
        gap = r.get("gap_at_equal_bytes_points") or {}
        print(f"  {name:<12}{ttt:>11}{speed:>22}{r['median_final_test_accuracy']:>11.4f}"
              f"{gap.get('median', 0.0):>+16.2f}{r['median_wall_time_s']:>8.1f}s"
              f"{r['median_bytes_per_worker_per_step']:>12,.0f}{r['mean_ratio']:>12.4f}")
    if "importance" in summary and summary["importance"].get("gap_to_adaptive_at_equal_bytes_points"):
        g = summary["importance"]["gap_to_adaptive_at_equal_bytes_points"]
        print(f"  importance - adaptive at equal bytes: {g['median']:+.2f} points (min {g['min']:+.2f}, max {g['max']:+.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ablation-repeats", type=int, default=None,
                        help=f"repeats of the configurations other than {', '.join(MAIN)} (default: --repeats)")
    parser.add_argument("--epochs", type=float, default=10.0)
    parser.add_argument("--eval-every", type=float, default=0.25, help="epochs between evaluations")
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
                print(f"[{time.time() - t0:6.0f}s] {name:<11} repeat {repeat}: final "
                      f"{row['final_test_accuracy']:.4f}, wall {row['wall_time_s']:.1f}s, "
                      f"{row['bytes_per_worker_per_step']:,.0f} B/step, load {row['load_before'][0]:.2f}", flush=True)
        summary = summarize(runs, names)
        print_table(summary)
        first = [load_run(Path(tmp) / f"{n}-0", label=f"{n}: {CONFIGS[n]}") for n in names]
        plots = make_plots(group_by_label(first), args.plots)
    result = {
        "scenario": {**{k: v for k, v in JOB.items() if k != "bandwidth_trace"},
                     "bandwidth_trace": relative(TRACE), "epochs": args.epochs,
                     "eval_every": args.eval_every, "level": LEVEL, "repeats": args.repeats,
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
