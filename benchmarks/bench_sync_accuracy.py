"""Final test accuracy of the synchronous algorithms on the default job, each as a user runs it.

Runs ``distrain train --algorithm X`` with every other setting at its default (1-D CNN,
MNIST-1D, 4 workers, 15 epochs, one parameter server for ``ps``), one after the other, and
compares each final test accuracy with ``allreduce``'s: the target is >= 0.95 and within one
point of ``allreduce``, in the same number of epochs.

    python benchmarks/bench_sync_accuracy.py                    # every configuration below
    python benchmarks/bench_sync_accuracy.py --only allreduce,ps-sync --epochs 2

Each configuration runs ``--repeats`` times (3 by default), alternated; its figure is the median
final test accuracy, with the minimum and maximum (the synchronous ones repeat exactly; the
asynchronous parameter server follows the machine's scheduling). Writes
``benchmarks/results/sync_accuracy.json`` (each run's summary figures and the load average
before and after it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import check_repeats, spread, write_result

RESULTS = Path(__file__).resolve().parent / "results"

#: name -> extra flags for ``distrain train`` (allreduce first: it is the reference)
CONFIGS: dict[str, list[str]] = {
    "allreduce": ["--algorithm", "allreduce"],
    "ps-sync": ["--algorithm", "ps"],
    "ps-async": ["--algorithm", "ps", "--ps-mode", "async"],
    "ps-async-staleness2": ["--algorithm", "ps", "--ps-mode", "async", "--max-staleness", "2"],
    "dpsgd-ring": ["--algorithm", "dpsgd", "--topology", "ring"],
    "d2-ring": ["--algorithm", "d2", "--topology", "ring"],
}


def run(name: str, flags: list[str], run_dir: Path, epochs: float | None) -> dict:
    cmd = [sys.executable, "-m", "distrain", "train", *flags, "--run-dir", str(run_dir), "--no-progress"]
    if epochs is not None:
        cmd += ["--epochs", str(epochs)]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"name": name, "command": "distrain train " + " ".join(flags), "epochs": summary["epochs"],
           "steps": summary["steps"], "final_test_accuracy": summary["final_test_accuracy"],
           "wall_time_s": summary["wall_time_s"], "elapsed_s": elapsed,
           "load_before": load_before, "load_after": os.getloadavg()[0]}
    print(f"{name:22s} accuracy {row['final_test_accuracy']:.4f}  epochs {row['epochs']:g}  "
          f"wall {row['wall_time_s']:.1f} s  load {load_before:.1f}->{row['load_after']:.1f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    parser.add_argument("--epochs", type=float, default=None, help="override the default epochs (quick looks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "sync_accuracy.json")
    args = parser.parse_args(argv)
    check_repeats(parser, args.repeats)
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="distrain-sync-accuracy-") as tmp:
        for repeat in range(args.repeats):
            for name in names:
                runs.append({**run(name, CONFIGS[name], Path(tmp) / f"{name}-{repeat}", args.epochs), "repeat": repeat})
    rows = [{"name": name, "command": "distrain train " + " ".join(CONFIGS[name]),
             "final_test_accuracy": spread([r["final_test_accuracy"] for r in runs if r["name"] == name])}
            for name in names]
    reference = next((r["final_test_accuracy"]["median"] for r in rows if r["name"] == "allreduce"), None)
    for r in rows:
        accuracy = r["final_test_accuracy"]["median"]
        r["meets_target"] = accuracy >= 0.95 and (reference is None or accuracy >= reference - 0.01)
    result = {"benchmark": "final test accuracy of the synchronous algorithms, default job",
              "reference": "allreduce", "target": ">= 0.95 and within 0.01 of allreduce",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "configs": rows, "runs": runs}
    print(f"wrote {write_result(args.out, result)}")
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
