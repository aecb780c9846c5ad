"""Final test accuracy of the synchronous algorithms on the default job, each as a user runs it.

Runs ``distrain train --algorithm X`` with every other setting at its default (1-D CNN,
MNIST-1D, 4 workers, 15 epochs, one parameter server for ``ps``), one after the other, and
compares each final test accuracy with ``allreduce``'s: the target is >= 0.95 and within one
point of ``allreduce``, in the same number of epochs.

``--job lm`` runs the default language-model job instead (``--model gpt --dataset text`` at its
defaults) with the same algorithms and ``diloco``, and compares final validation bits per byte
(lower is better) with ``allreduce``'s: the target is within 5% of it. It writes
``sync_accuracy_lm.json``.

    python benchmarks/bench_sync_accuracy.py                    # every configuration below
    python benchmarks/bench_sync_accuracy.py --only allreduce,ps-sync --epochs 2
    python benchmarks/bench_sync_accuracy.py --job lm

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
#: the language-model job's flags, and the configurations it adds
LM_JOB = ["--model", "gpt", "--dataset", "text"]
LM_CONFIGS: dict[str, list[str]] = {**CONFIGS, "diloco": ["--algorithm", "diloco"]}


def run(name: str, flags: list[str], run_dir: Path, epochs: float | None, job: list[str] | None = None) -> dict:
    cmd = [sys.executable, "-m", "distrain", "train", *(job or []), *flags, "--run-dir", str(run_dir), "--no-progress"]
    if epochs is not None:
        cmd += ["--epochs", str(epochs)]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"name": name, "command": "distrain train " + " ".join(flags), "epochs": summary["epochs"],
           "steps": summary["steps"], "final_test_accuracy": summary["final_test_accuracy"],
           "final_val_bpb": summary.get("final_val_bpb"),
           "wall_time_s": summary["wall_time_s"], "elapsed_s": elapsed,
           "load_before": load_before, "load_after": os.getloadavg()[0]}
    quality = (f"accuracy {row['final_test_accuracy']:.4f}" if row["final_val_bpb"] is None
               else f"val {row['final_val_bpb']:.3f} bpb")
    print(f"{name:22s} {quality}  epochs {row['epochs']:g}  "
          f"wall {row['wall_time_s']:.1f} s  load {load_before:.1f}->{row['load_after']:.1f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    parser.add_argument("--epochs", type=float, default=None, help="override the default epochs (quick looks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job", choices=("default", "lm"), default="default",
                        help="the default job (accuracy) or the default language-model job (bits per byte)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/sync_accuracy[_lm].json")
    args = parser.parse_args(argv)
    check_repeats(parser, args.repeats)
    lm = args.job == "lm"
    configs, job = (LM_CONFIGS, LM_JOB) if lm else (CONFIGS, [])
    out = args.out or RESULTS / ("sync_accuracy_lm.json" if lm else "sync_accuracy.json")
    names = [n for n in args.only.split(",") if n] or list(configs)
    unknown = [n for n in names if n not in configs]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {', '.join(configs)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="distrain-sync-accuracy-") as tmp:
        for repeat in range(args.repeats):
            for name in names:
                runs.append({**run(name, configs[name], Path(tmp) / f"{name}-{repeat}", args.epochs, job),
                             "repeat": repeat})
    key = "final_val_bpb" if lm else "final_test_accuracy"
    rows = [{"name": name, "command": "distrain train " + " ".join(job + configs[name]),
             key: spread([r[key] for r in runs if r["name"] == name])} for name in names]
    reference = next((r[key]["median"] for r in rows if r["name"] == "allreduce"), None)
    for r in rows:
        value = r[key]["median"]
        if lm:
            r["meets_target"] = reference is None or value <= 1.05 * reference
        else:
            r["meets_target"] = value >= 0.95 and (reference is None or value >= reference - 0.01)
    result = {"benchmark": ("final validation bits per byte of the synchronous algorithms and diloco, default "
                            "language-model job") if lm else "final test accuracy of the synchronous algorithms, default job",
              "reference": "allreduce",
              "target": "within 5% of allreduce's bits per byte" if lm else ">= 0.95 and within 0.01 of allreduce",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "configs": rows, "runs": runs}
    print(f"wrote {write_result(out, result)}")
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
