"""Group top-k against DDP and PyTorch's compression hooks on the edge network, side by side.

One ``distrain compare`` grid on the ``edge`` preset (20 Mbit/s, 10 ms links, in-process link
model), ~1M-parameter MLP (``--model mlp --model-width 974``: 999,334 parameters) on MNIST-1D, 4
workers: distrain's all-reduce with ``group_topk:0.01`` (error feedback, momentum correction) and
the PyTorch baselines run under the same emulation: DDP (``allreduce_hook``), DDP with
``fp16_compress_hook``, DDP with ``powerSGD_hook`` at rank 2 and 4. Every configuration trains the
same model, data, seed and schedule; compression starts at step 0 (no density warm-up, PowerSGD
after PyTorch's minimum of 2 dense iterations) because on this link a dense step costs ~15 sparse
ones.

Reports, per configuration, time to the target accuracy (training time, evaluation excluded),
final accuracy, bytes sent per worker per step (Transport counters, or the wire wrapper's for the
baselines), and the speed-up in time to target over dense DDP: the median over repeats (3 by
default) of the per-repeat ratio DDP's time / this configuration's, with its minimum and maximum
(``speedup_vs_ddp``). The target should be one that every configuration reaches (``--target``);
a configuration that misses it in a repeat has no ratio for that repeat.

    python benchmarks/bench_edge_compression.py                       # ~30 min on 2 idle cores
    python benchmarks/bench_edge_compression.py --epochs 1 --target 0.4
    python benchmarks/bench_edge_compression.py --sparse-collective ring

Writes ``benchmarks/results/edge_compression.json`` (and the compare output, plots included, under
``benchmarks/results/edge-compression/``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from provenance import check_repeats, ratio_spread, relative, write_result

from distrain.cli import main as distrain_main

RESULTS = Path(__file__).resolve().parent / "results"
BASELINES = "ddp,ddp-fp16,ddp-powersgd:2,ddp-powersgd:4"


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def time_to(run_dir: Path, targets: list[float]) -> dict[str, float | None]:
    """Training time (evaluation excluded) at which rank 0's test accuracy first reached each target."""
    lines = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines() if line]
    evals = [(line["time"], line["test_accuracy"]) for line in lines if line.get("test_accuracy") is not None]
    return {f"{t:g}": next((time for time, acc in evals if acc >= t), None) for t in targets}


def sweep(comparison: dict[str, Any], out: Path, targets: list[float]) -> dict[str, dict[str, Any]]:
    """Per configuration (first repeat): time to each target, and DDP's time over it."""
    times = {c["label"]: time_to(out / c["runs"][0]["run_dir"], targets)
             for c in comparison["configs"] if c["runs"] and c["runs"][0].get("status") == "ok"}
    ddp = times.get("ddp", {})
    return {label: {t: {"time_s": v, "speedup_vs_ddp": ddp[t] / v if v and ddp.get(t) else None} for t, v in row.items()}
            for label, row in times.items()}


def rows(comparison: dict[str, Any]) -> list[dict[str, Any]]:
    by_label = {c["label"]: c for c in comparison["configs"]}
    ddp = by_label.get("ddp", {}).get("time_to_target_s")
    ddp_time = ddp["mean"] if ddp and ddp.get("mean") is not None else None
    ddp_runs = [r.get("time_to_target_s") if r.get("status") == "ok" else None for r in by_label.get("ddp", {}).get("runs", [])]
    out = []
    for c in comparison["configs"]:
        runs = [r for r in c["runs"] if r.get("status") == "ok"]
        ttt = c.get("time_to_target_s") or {}
        mean = ttt.get("mean") if c.get("target_reached") == len(runs) and runs else None
        per_step = [r["bytes_sent_per_worker_mean"] / r["steps"] for r in runs if r.get("steps")]
        out.append({
            "label": c["label"], "status": c["status"],
            "final_test_accuracy": (c.get("final_test_accuracy") or {}).get("mean"),
            "time_to_target_s": mean,
            "wall_time_s": (c.get("wall_time_s") or {}).get("mean"),
            "bytes_sent_per_worker_per_step": sum(per_step) / len(per_step) if per_step else None,
            "speedup_time_to_target_vs_ddp": ddp_time / mean if ddp_time and mean else None,
            "speedup_vs_ddp": ratio_spread(ddp_runs, [r.get("time_to_target_s") if r.get("status") == "ok" else None
                                                      for r in c["runs"]]) if len(ddp_runs) == len(c["runs"]) else None,
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--target", type=float, default=0.5, help="target test accuracy (0..1)")
    parser.add_argument("--eval-every", type=float, default=0.1, help="epochs between evaluations")
    parser.add_argument("--compress", default="group_topk:0.01", help="comma-separated compressor specs")
    parser.add_argument("--sparse-collective", default="allgather", choices=("ring", "allgather"))
    parser.add_argument("--baselines", default=BASELINES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", default="0.3,0.35,0.4,0.45,0.5,0.55,0.6,0.65,0.7",
                        help="targets for the time-to-accuracy sweep, read from the runs' metrics")
    parser.add_argument("--out", type=Path, default=RESULTS / "edge-compression")
    parser.add_argument("--summary", type=Path, default=RESULTS / "edge_compression.json")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)

    flags = ["--network", "edge", "--dataset", "mnist1d", "--model", "mlp", "--model-width", "974",
             "--workers", "4", "--batch-size", "64", "--epochs", str(args.epochs), "--eval-every", str(args.eval_every),
             "--target-accuracy", str(args.target), "--density-warmup-epochs", "0", "--density-decay-epochs", "0",
             "--sparse-collective", args.sparse_collective, "--seed", "0", "--repeats", str(args.repeats)]
    # DDP first: the baseline the speed-ups are measured against (compare runs the grid in order:
    # algorithms, then baselines; --baseline names it).
    command = ["compare", "--algorithms", "allreduce", "--compress", args.compress, "--baselines", args.baselines,
               "--baseline", "ddp", "--out", str(args.out), "--overwrite", *flags]  # a new run replaces the last
    load_before = os.getloadavg()
    start = time.perf_counter()
    code = distrain_main(command)
    elapsed = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"distrain compare exited with {code}")
    table = rows(load(args.out / "comparison.json"))
    summary = {"compare_command": "distrain " + " ".join(command[:-len(flags)]).replace(str(args.out), relative(args.out))
               + " " + " ".join(flags), "elapsed_s": elapsed,
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "target_accuracy": args.target, "epochs": args.epochs, "configs": table,
               "sweep": sweep(load(args.out / "comparison.json"), args.out,
                              [float(t) for t in args.sweep.split(",") if t])}
    write_result(args.summary, summary)
    write_result(args.out / "comparison.json", load(args.out / "comparison.json"))  # compare's own file: provenance too
    print(f"\nedge, ~1M-parameter MLP, 4 workers, {args.epochs:g} epochs, target {args.target:.0%}; "
          f"load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"  {'configuration':<34}{'accuracy':>9}{'to target':>11}{'bytes/step':>13}{'vs DDP':>8}  (median [min-max])")
    for r in table:
        ttt = f"{r['time_to_target_s']:.1f}s" if r["time_to_target_s"] is not None else "-"
        s = r["speedup_vs_ddp"] or {}
        speed = f"{s['median']:.1f}x [{s['min']:.1f}-{s['max']:.1f}]" if s.get("median") and s.get("max") else "-"
        acc = f"{r['final_test_accuracy']:.4f}" if r["final_test_accuracy"] is not None else "-"
        per_step = f"{r['bytes_sent_per_worker_per_step']:,.0f}" if r["bytes_sent_per_worker_per_step"] else "-"
        print(f"  {r['label']:<34}{acc:>9}{ttt:>11}{per_step:>13}{speed:>8}")
    print("  time to each target (s), and DDP's time over it:")
    for label, row in summary["sweep"].items():
        cells = [f"{t}: {v['time_s']:.0f}s" + (f" ({v['speedup_vs_ddp']:.1f}x)" if v["speedup_vs_ddp"] else "")
                 if v["time_s"] is not None else f"{t}: -" for t, v in row.items()]
        print(f"  {label:<34}" + "  ".join(cells))
    print(f"wrote {args.summary} and {args.out}/")


if __name__ == "__main__":
    main()
