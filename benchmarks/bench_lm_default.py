"""The default language-model job: how long it takes and how far below the bigram baseline it ends.

Runs ``distrain train --model gpt --dataset text`` with every other setting at its default (the
language-model defaults: 4 workers, all-reduce, the 0.22M-parameter GPT on the Python standard
library's sources, byte tokens) ``--repeats`` times (3), after one untimed warm-up run that fills
the token cache (the acceptance counts the job "once the corpus is cached"). Per repeat: the wall
time of the whole command (process start to exit, as a user waits for it), the run's own
``wall_time_s``, ``final_val_bpb``, ``bigram_val_bpb`` (the bigram model of the same run) and
their ratio. The figures are the median over repeats, with min and max. Targets: wall time at
most 180 s, ratio at most 0.85.

    python benchmarks/bench_lm_default.py
    python benchmarks/bench_lm_default.py --repeats 1 --epochs 0.05     # a quick look

Writes ``benchmarks/results/lm_default_job.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import check_repeats, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COMMAND = ["-m", "distrain", "train", "--model", "gpt", "--dataset", "text", "--no-progress"]


def run(run_dir: Path, epochs: float | None) -> dict:
    cmd = [sys.executable, *COMMAND, "--run-dir", str(run_dir)]
    if epochs is not None:
        cmd += ["--epochs", str(epochs)]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, timeout=3600)
    wall = time.perf_counter() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"command_wall_s": wall, "wall_time_s": summary["wall_time_s"], "final_val_bpb": summary["final_val_bpb"],
            "bigram_val_bpb": summary["bigram_val_bpb"],
            "bpb_over_bigram": summary["final_val_bpb"] / summary["bigram_val_bpb"],
            "tokens_per_s": summary.get("tokens_per_s"), "steps": summary["steps"], "load_before": load_before}


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=float, default=None, help="default: the job's own")
    parser.add_argument("--out", type=Path, default=RESULTS / "lm_default_job.json")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_lm_default-") as tmp:
        run(Path(tmp) / "warm-up", 0.01)  # fills the token cache; not counted
        for repeat in range(args.repeats):
            row = run(Path(tmp) / f"run-{repeat}", args.epochs)
            rows.append(row)
            print(f"repeat {repeat}: {row['command_wall_s']:.1f} s, val {row['final_val_bpb']:.3f} bpb, bigram "
                  f"{row['bigram_val_bpb']:.3f} ({row['bpb_over_bigram']:.3f}x), load {row['load_before']:.2f}", flush=True)
    summary = {key: stats([r[key] for r in rows]) for key in ("command_wall_s", "wall_time_s", "final_val_bpb",
                                                              "bigram_val_bpb", "bpb_over_bigram")}
    summary["within_180_s"] = summary["command_wall_s"]["median"] <= 180
    summary["within_0_85_of_bigram"] = summary["bpb_over_bigram"]["median"] <= 0.85
    print(f"median {summary['command_wall_s']['median']:.1f} s (min {summary['command_wall_s']['min']:.1f}, max "
          f"{summary['command_wall_s']['max']:.1f}); val/bigram {summary['bpb_over_bigram']['median']:.3f}")
    result = {"command": "distrain train --model gpt --dataset text", "epochs": args.epochs, "repeats": args.repeats,
              "cpus": os.cpu_count(), "summary": summary, "runs": rows}
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
