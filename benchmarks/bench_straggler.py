"""Time to accuracy of the asynchronous algorithms against synchronous all-reduce on uneven clusters.

The default job (4 workers, 1-D CNN on MNIST-1D, 15 epochs) on three emulated networks:

- ``straggler``: 10 Gbit/s links; the last worker computes 4x slower. Ideal speed-up of an
  algorithm that never waits: (3 + 1/4) / 1 = 3.25 (target >= 2.5 for adpsgd).
- ``slow-link``: 100 Mbit/s links; the last worker's link is 10 Mbit/s (target >= 2 for prague).
- ``lan``: 10 Gbit/s, 0.1 ms, everyone equal (target: within 1.2x of allreduce).

The figure of merit is time to ``--target`` test accuracy (seconds of training from the common
start, evaluation excluded): all-reduce evaluates every ``--eval-every`` epochs (its evaluation
pauses the clock); the asynchronous algorithms copy every worker's model every
``--snapshot-every`` seconds and the consensus of those copies is evaluated after the run (see
``distrain/algorithms/gossip.py``), so nothing is paused. Runs of one repeat are interleaved
(allreduce, adpsgd, prague, then the next repeat in a rotated order) so drifting machine load
hits all alike; each figure is the median over repeats (3 by default), and each ratio is the
median of the per-repeat ratios (repeat i of one algorithm over repeat i of the other), with its
minimum and maximum.

``--device-slowdown F`` emulates devices F times slower than this host: every worker's compute
is stretched F times (by sleeping, as the straggler's is) and the straggler's 4F times, so it is
still 4x slower than the others. Four workers on a 2-core host cannot all compute at once; the
asynchronous algorithms, whose fast workers never wait, then run out of cores while all-reduce
(paced by the straggler) leaves them idle, and the ratio measures the host, not the algorithm.
With F large enough that the fast workers' CPU fits the cores (``cpu_s_per_worker`` in the
results against the wall time shows it), the ratio is the one a cluster of real devices sees.

    python benchmarks/bench_straggler.py                          # 3 repeats, all scenarios
    python benchmarks/bench_straggler.py --scenarios straggler --repeats 1
    python benchmarks/bench_straggler.py --scenarios straggler --device-slowdown 4 \
        --output benchmarks/results/straggler_devices.json

Writes ``benchmarks/results/straggler.json`` (every run) and prints a table.
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
from provenance import check_repeats, ratio_spread, write_result

from distrain.config import TrainConfig
from distrain.emulation.network import PRESETS
from distrain.launch import launch_local

RESULTS = Path(__file__).parent / "results"

SCENARIOS: dict[str, list[str]] = {
    "straggler": ["allreduce", "adpsgd", "prague"],
    "slow-link": ["allreduce", "prague", "adpsgd"],
    "lan": ["allreduce", "adpsgd", "prague"],
}
#: (numerator, denominator, target): time to accuracy of one over the other, and the aim.
TARGETS: dict[str, list[tuple[str, str, str]]] = {
    "straggler": [("allreduce", "adpsgd", ">= 2.5"), ("allreduce", "prague", "report")],
    "slow-link": [("allreduce", "prague", ">= 2"), ("allreduce", "adpsgd", "report")],
    "lan": [("adpsgd", "allreduce", "<= 1.2"), ("prague", "allreduce", "<= 1.2")],
}


def job(algorithm: str, network: str, args: argparse.Namespace, run_dir: Path) -> TrainConfig:
    return TrainConfig.from_dict({
        "algorithm": algorithm, "network": network, "workers": args.workers, "epochs": args.epochs,
        "eval_every": args.eval_every, "target_accuracy": args.target,
        **({"snapshot_every": args.snapshot_every} if algorithm in ("adpsgd", "prague") else {}), "seed": args.seed, "progress": False, "run_dir": str(run_dir), **device_slowdown(network, args),
    }).validate()


def device_slowdown(network: str, args: argparse.Namespace) -> dict[str, str]:
    """``--slow-worker`` stretching every worker's compute ``--device-slowdown`` times on top of the
    preset's own slowdowns (the straggler preset's last worker: 4x that)."""
    factor = args.device_slowdown
    if factor == 1:
        return {}
    preset = PRESETS[network].get("slow_worker", "")
    extra = {spec.split(":")[0]: float(spec.split(":")[1].rstrip("x")) for spec in preset.split(",") if spec}
    last = str(args.workers - 1)
    factors = [factor * extra.get(str(r), extra.get("last", 1.0) if str(r) == last else 1.0) for r in range(args.workers)]
    return {"slow_worker": ",".join(f"{r}:{f:g}x" for r, f in enumerate(factors))}


def run_one(algorithm: str, network: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    s = launch_local(job(algorithm, network, args, run_dir))
    return {
        "algorithm": algorithm, "network": network, "time_to_target_s": s["time_to_target_s"],
        "final_test_accuracy": s["final_test_accuracy"], "wall_time_s": s["wall_time_s"],
        "steps_per_worker": s["steps_per_worker"], "bytes_sent_per_worker": s["bytes_sent_per_worker"],
        "cpu_s_per_worker": s["cpu_s_per_worker"],  # against wall time: were the host's cores the limit?
        "launch_s": time.perf_counter() - started,
    }


def median(values: list[float | None]) -> float | None:
    """Median, counting a run that never reached the target as infinitely slow."""
    if not values:
        return None
    m = statistics.median([float("inf") if v is None else v for v in values])
    return None if m == float("inf") else m


def summarize(runs: list[dict[str, Any]], scenarios: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for network in scenarios:
        per_algo = {}
        for algorithm in SCENARIOS[network]:
            mine = [r for r in runs if r["network"] == network and r["algorithm"] == algorithm]
            per_algo[algorithm] = {
                "time_to_target_s": median([r["time_to_target_s"] for r in mine]),
                "final_test_accuracy": median([r["final_test_accuracy"] for r in mine]),
                "wall_time_s": median([r["wall_time_s"] for r in mine]),
                "runs": len(mine),
            }
        ratios = []
        for num, den, aim in TARGETS[network]:
            times = {algo: [r["time_to_target_s"] for r in sorted(runs, key=lambda r: r["repeat"])
                            if r["network"] == network and r["algorithm"] == algo] for algo in (num, den)}
            per_repeat = ratio_spread(times[num], times[den])
            ratios.append({"ratio": f"{num} / {den}", "value": per_repeat["median"], "per_repeat": per_repeat, "aim": aim})
        out[network] = {"algorithms": per_algo, "ratios": ratios}
    return out


def print_table(summary: dict[str, Any], target: float) -> None:
    for network, result in summary.items():
        print(f"\n{network}")
        print(f"  {'algorithm':<11}{f'time to {target:.0%}':>16}{'final acc':>11}{'wall':>9}")
        for algorithm, r in result["algorithms"].items():
            ttt = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s"
            print(f"  {algorithm:<11}{ttt:>16}{r['final_test_accuracy']:>11.4f}{r['wall_time_s']:>8.1f}s")
        for ratio in result["ratios"]:
            value = "n/a" if ratio["value"] is None else f"{ratio['value']:.2f}"
            print(f"  {ratio['ratio']:<24}{value:>8}   (aim {ratio['aim']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="straggler,slow-link,lan")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=15)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--eval-every", type=float, default=0.25, help="all-reduce: epochs between evaluations")
    parser.add_argument("--snapshot-every", type=float, default=0.25, help="adpsgd, prague: seconds between snapshots")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device-slowdown", type=float, default=1.0,
                        help="every worker computes this many times slower than the host (the straggler 4x that)")
    parser.add_argument("--output", default=str(RESULTS / "straggler.json"))
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    if not args.device_slowdown >= 1:
        parser.error(f"--device-slowdown must be >= 1, got {args.device_slowdown}")
    scenarios = [s for s in args.scenarios.split(",") if s]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for network in scenarios:
                algorithms = SCENARIOS[network]
                shift = repeat % len(algorithms)
                for algorithm in algorithms[shift:] + algorithms[:shift]:
                    run = run_one(algorithm, network, args, Path(tmp) / f"{network}-{algorithm}-{repeat}")
                    run["repeat"] = repeat
                    runs.append(run)
                    ttt = run["time_to_target_s"]
                    print(f"[{repeat}] {network:<10}{algorithm:<11}time to target "
                          f"{'-' if ttt is None else f'{ttt:.1f} s'}, accuracy {run['final_test_accuracy']:.4f}, "
                          f"wall {run['wall_time_s']:.1f} s", flush=True)
    summary = summarize(runs, scenarios)
    print_table(summary, args.target)
    result = {
        "benchmark": "time to accuracy on uneven clusters", "settings": vars(args), "summary": summary, "runs": runs,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_average_at_end": os.getloadavg()},
    }
    print(f"\nwrote {write_result(args.output, result)}")


if __name__ == "__main__":
    main()
