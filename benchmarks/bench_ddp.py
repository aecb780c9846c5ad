"""distrain's all-reduce against PyTorch DistributedDataParallel: step time on the same job.

Both sides train the same model on the same shards with the same schedule, 4 workers on
loopback (gloo), one thread each; runs alternate (distrain, DDP, distrain, ...) so that drifting
machine load hits both alike. The figure of merit is the median over repeats (5 by default, at
least 3 for a published figure) of the per-repeat ratio distrain / DDP, with its minimum and
maximum (``ratio`` in the results; target <= 1.10, goal <= 1.0). A run's step time is the median of its steps'
durations on rank 0 (the mean, wall time over steps, is recorded too).

DDP is ``torch.nn.parallel.DistributedDataParallel`` with its built-in C++ all-reduce (no
communication hook; ``bucket_cap_mb`` = ``--bucket-mb``, 25 MB, for every bucket: DDP keeps its
1 MB first bucket only when no size is given), run by the worker of :mod:`distrain.baselines`
so data, model, schedule and run-directory format match ``distrain train``. Both sides build
the same buckets (``tests/distributed/test_buckets.py``): for the MLP one 4 MB bucket, one
all-reduce per step. ``--ddp hooked`` runs the ``ddp`` baseline of ``distrain compare``
instead (DDP plus a Python hook that counts bytes).

``--via wrap`` measures what a user's own script gets: ``benchmarks/user_loop.py``, one loop run
as DDP and as ``distrain.wrap(model, optimizer)`` (the two differ in the wrapping lines only),
both started by ``distrain launch``; a run's step time is the median of rank 0's step durations
after 5 warm-up steps. The statistic is the same: the median over repeats of the per-repeat
ratio wrap / DDP, with min and max (target <= 1.00).

    python benchmarks/bench_ddp.py                         # both models, 5 repeats, 4 workers
    python benchmarks/bench_ddp.py --models mlp --repeats 3 --epochs 1
    python benchmarks/bench_ddp.py --via wrap              # a user's loop: wrap() against DDP

Writes ``benchmarks/results/ddp.json`` (``--via wrap``: ``ddp_wrap.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from provenance import check_repeats, ratio_spread, write_result

from distrain.baselines import build_peer
from distrain.baselines.common import Peer, launch_peer
from distrain.config import TrainConfig
from distrain.launch import launch_local
from distrain.models import build_model, count_parameters
from distrain.train.metrics import read_metrics

RESULTS = Path(__file__).parent / "results"
WARMUP = 5  # steps left out of the step time

MODELS: dict[str, dict[str, Any]] = {
    "cnn1d": {"model": "cnn1d"},  # 13,770 parameters: compute-bound
    "mlp": {"model": "mlp", "model_width": 974},  # 999,334 parameters (4 MB of gradients): communication-bound
}


class NativeDDP(Peer):
    """DDP exactly as PyTorch ships it: no communication hook, the C++ reducer all-reduces."""

    name = "ddp-native"


def job(model: str, workers: int, epochs: float, run_dir: Path, algorithm: str = "allreduce") -> TrainConfig:
    settings = {**MODELS[model], "algorithm": algorithm, "workers": workers, "epochs": epochs,
                "eval_every": 1000.0, "progress": False, "run_dir": str(run_dir)}
    return TrainConfig.from_dict(settings).validate()


def step_time(summary: dict[str, Any]) -> float:
    """Median time of one training step on rank 0 (the first steps, warm-up, left out): on a
    shared machine the median shrugs off bursts of load that the mean (wall / steps) absorbs."""
    times = [r["time"] for r in read_metrics(summary["run_dir"], 0) if not r.get("snapshot")]
    steps = [b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1 :], strict=False)]
    return statistics.median(steps)


USER_LOOP = Path(__file__).with_name("user_loop.py")


def user_loop_step_time(mode: str, model: str, args: argparse.Namespace, out: Path) -> float:
    """Median step time of rank 0 of ``user_loop.py MODE`` under ``distrain launch``."""
    steps = max(WARMUP + 20, round(args.epochs * 20000 * 0.8 / (args.workers * 64)))  # the --epochs of the job
    command = [sys.executable, "-m", "distrain", "launch", "--workers", str(args.workers), str(USER_LOOP), mode,
               model, str(steps), str(out)]
    subprocess.run(command, check=True, timeout=1800, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return float(json.loads(out.read_text())["median_step_s"])


def run_pair(model: str, args: argparse.Namespace, repeat: int, tmp: Path) -> dict[str, float]:
    if args.via == "wrap":
        times: dict[str, float] = {"load_before": os.getloadavg()[0]}
        for side in (["distrain", "ddp"] if repeat % 2 == 0 else ["ddp", "distrain"]):  # neither always first
            times[side] = user_loop_step_time("wrap" if side == "distrain" else "ddp", model, args,
                                              tmp / f"{model}-{side}-{repeat}.json")
        times["ratio"] = times["distrain"] / times["ddp"]
        times["load_after"] = os.getloadavg()[0]
        return times
    peer = NativeDDP() if args.ddp == "native" else build_peer("ddp")
    times = {}
    order = ["distrain", "ddp"] if repeat % 2 == 0 else ["ddp", "distrain"]  # neither always goes first
    times["load_before"] = os.getloadavg()[0]
    for side in order:
        cfg = job(model, args.workers, args.epochs, tmp / f"{model}-{side}-{repeat}")
        summary = launch_local(cfg) if side == "distrain" else launch_peer(cfg, peer)
        times[side] = step_time(summary)
        times[f"{side}_mean"] = summary["wall_time_s"] / summary["steps"]
        times[f"{side}_accuracy"] = summary["final_test_accuracy"]
    times["ratio"] = times["distrain"] / times["ddp"]
    times["load_after"] = os.getloadavg()[0]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn1d,mlp")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=6.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ddp", choices=("native", "hooked"), default="native")
    parser.add_argument("--via", choices=("train", "wrap"), default="train",
                        help="train: distrain train against the DDP baseline; wrap: a user's loop (user_loop.py)")
    parser.add_argument("--out", default=None, help="results file (default: results/ddp.json, --via wrap: ddp_wrap.json)")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    args.out = args.out or str(RESULTS / ("ddp_wrap.json" if args.via == "wrap" else "ddp.json"))
    target = 1.00 if args.via == "wrap" else 1.10

    results: dict[str, Any] = {
        "benchmark": "distrain allreduce vs torch DDP, step time", "workers": args.workers, "epochs": args.epochs,
        "repeats": args.repeats, "ddp": args.ddp, "via": args.via, "target_ratio": target, "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads available", "models": {},
    }
    print(f"{'model':<8}{'params':>10}{'repeat':>8}{'distrain ms':>13}{'DDP ms':>9}{'ratio':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            params = count_parameters(build_model(MODELS[model]["model"], (40,), 10, width=MODELS[model].get("model_width")))
            rows = []
            for repeat in range(args.repeats):
                row = run_pair(model, args, repeat, Path(tmp))
                rows.append(row)
                print(f"{model:<8}{params:>10}{repeat:>8}{row['distrain'] * 1e3:>13.2f}{row['ddp'] * 1e3:>9.2f}{row['ratio']:>8.3f}",
                      flush=True)
            ratios = [r["ratio"] for r in rows]
            summary = {
                "parameters": params, "runs": rows,
                "median_step_s": {"distrain": statistics.median(r["distrain"] for r in rows),
                                  "ddp": statistics.median(r["ddp"] for r in rows)},
                "ratio": ratio_spread([r["distrain"] for r in rows], [r["ddp"] for r in rows]),
                "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
                "load_average": [min(r["load_before"] for r in rows), max(r["load_after"] for r in rows)],
            }
            summary["ratio_of_medians"] = summary["median_step_s"]["distrain"] / summary["median_step_s"]["ddp"]
            results["models"][model] = summary
    print()
    print(f"{'model':<8}{'median distrain ms':>20}{'median DDP ms':>15}{'median ratio':>14}{f'target <= {target:.2f}':>16}")
    for model, s in results["models"].items():
        ok = "yes" if s["median_ratio"] <= target else "NO"
        print(f"{model:<8}{s['median_step_s']['distrain'] * 1e3:>20.2f}{s['median_step_s']['ddp'] * 1e3:>15.2f}"
              f"{s['median_ratio']:>14.3f}{ok:>16}")
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"load average (1 min) during the runs: {min(r['load_before'] for s in results['models'].values() for r in s['runs']):.1f}"
          f" to {max(r['load_after'] for s in results['models'].values() for r in s['runs']):.1f}")
    print(f"\nwrote {write_result(args.out, results)}")


if __name__ == "__main__":
    main()
