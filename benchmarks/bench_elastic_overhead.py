"""What elasticity costs a run that loses nobody: the default job's step time with the survivors'
safeguards on (the default: a copy of each bucket's own gradients as its all-reduce starts,
waits that poll the store every 50 ms, a heartbeat a second) against ``--min-workers 4``
(no elasticity), for the default CNN and the ~1M-parameter MLP, with ``--algorithm`` (default
``allreduce``; for ``dpsgd`` the safeguards are the point-to-point waits that run in a thread of
their own while the caller polls the store; for ``prague``, the group generator's write of every
group to the store, the waits for a group that poll the store, and each worker's thread watching
for the generator's loss: with ``--min-workers 4`` a lost worker stops the run and none of them
runs); for ``ps`` with ``--servers 2`` (or more), each step's wait for the servers' answers in a
thread of its own while the caller looks in the store for a server lost as it answered the step
before, once the wait lasts 0.2 s.

Per model and repeat (``--repeats``, 3), the two runs go back to back in alternating order; the
figure is the median over repeats of the per-repeat ratio of training wall times (elastic over
not elastic), with min and max. No target: it is the price of going on after a loss.

    python benchmarks/bench_elastic_overhead.py
    python benchmarks/bench_elastic_overhead.py --algorithm dpsgd --models cnn1d --out benchmarks/results/elastic_overhead_dpsgd.json
    python benchmarks/bench_elastic_overhead.py --algorithm prague --models cnn1d --out benchmarks/results/elastic_overhead_prague.json
    python benchmarks/bench_elastic_overhead.py --algorithm ps --servers 2 --models cnn1d --out benchmarks/results/elastic_overhead_ps.json

Writes ``benchmarks/results/elastic_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import check_repeats, ratio_spread, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {"cnn1d": [], "mlp": ["--model", "mlp", "--model-width", "974"]}


def train(run_dir: Path, flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "distrain", "train", "--no-progress", "--run-dir", str(run_dir), *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, timeout=1800)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"wall_time_s": summary["wall_time_s"], "final_test_accuracy": summary["final_test_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="cnn1d,mlp")
    parser.add_argument("--algorithm", default="allreduce")
    parser.add_argument("--servers", type=int, default=0, help="parameter servers (ps only; 0: the default)")
    parser.add_argument("--out", type=Path, default=RESULTS / "elastic_overhead.json")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    if args.servers and args.algorithm != "ps":
        parser.error(f"--servers: for --algorithm ps only, got --algorithm {args.algorithm}")
    servers = ["--servers", str(args.servers)] if args.servers else []
    result: dict = {"algorithm": args.algorithm, "servers": args.servers or None, "repeats": args.repeats,
                    "cpus": os.cpu_count(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench_elastic_overhead-") as tmp:
        for model in args.models.split(","):
            rows = []
            for repeat in range(args.repeats):
                order = ["elastic", "fixed"] if repeat % 2 == 0 else ["fixed", "elastic"]
                row = {}
                for kind in order:
                    flags = ["--algorithm", args.algorithm, *servers, *MODELS[model],
                             *([] if kind == "elastic" else ["--min-workers", "4"])]
                    row[kind] = train(Path(tmp) / f"{model}-{repeat}-{kind}", flags)
                rows.append(row)
                print(f"{model} repeat {repeat}: elastic {row['elastic']['wall_time_s']:.2f} s, fixed "
                      f"{row['fixed']['wall_time_s']:.2f} s", flush=True)
            ratio = ratio_spread([r["elastic"]["wall_time_s"] for r in rows], [r["fixed"]["wall_time_s"] for r in rows])
            result["models"][model] = {"elastic_over_fixed_wall": ratio, "runs": rows}
            print(f"{model}: elastic / fixed wall time {ratio['median']:.3f} (min {ratio['min']:.3f}, max "
                  f"{ratio['max']:.3f})", flush=True)
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
