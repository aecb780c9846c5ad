"""The default job at this commit against an earlier one: is a change free for the user?

Runs ``distrain train`` with every setting at its default (1-D CNN, MNIST-1D, 4 workers, 15
epochs) from this checkout and from a clean checkout of ``--baseline`` (a git worktree in a
temporary directory, with this checkout's Python), alternating (baseline, this, baseline, ...)
so that drifting machine load hits both alike. Per repeat: the wall-time ratio this / baseline
and the accuracy difference this - baseline in points; the figures are the medians over
``--repeats`` (3 by default) with min and max. Targets: accuracy within 0.3 points, wall time
within 5% (ratio in [0.95, 1.05]).

    python benchmarks/bench_default_job.py --baseline ac28cbe
    python benchmarks/bench_default_job.py --baseline HEAD~3 --epochs 2 --repeats 3

Writes ``benchmarks/results/default_job.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import check_repeats, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def run(source: Path, run_dir: Path, epochs: float | None) -> dict:
    cmd = [sys.executable, "-m", "distrain", "train", "--run-dir", str(run_dir), "--no-progress"]
    if epochs is not None:
        cmd += ["--epochs", str(epochs)]
    load_before = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": str(source / "src")}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=source, env=env, timeout=3600)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"final_test_accuracy": summary["final_test_accuracy"], "wall_time_s": summary["wall_time_s"],
            "steps": summary["steps"], "load_before": load_before, "load_after": os.getloadavg()[0]}


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare with (any git revision)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=float, default=None, help="default: the job's own (15)")
    parser.add_argument("--out", type=Path, default=RESULTS / "default_job.json")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    commit = subprocess.run(["git", "rev-parse", args.baseline], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), commit], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for repeat in range(args.repeats):
                row = {}
                for side, source in (("baseline", base), ("this", ROOT)):
                    row[side] = run(source, Path(tmp) / f"{side}-{repeat}", args.epochs)
                row["wall_ratio"] = row["this"]["wall_time_s"] / row["baseline"]["wall_time_s"]
                row["accuracy_points"] = 100 * (row["this"]["final_test_accuracy"] - row["baseline"]["final_test_accuracy"])
                rows.append(row)
                print(f"repeat {repeat}: baseline {row['baseline']['final_test_accuracy']:.4f} "
                      f"{row['baseline']['wall_time_s']:.1f} s, this {row['this']['final_test_accuracy']:.4f} "
                      f"{row['this']['wall_time_s']:.1f} s, wall ratio {row['wall_ratio']:.3f}, "
                      f"accuracy {row['accuracy_points']:+.2f} points", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    result = {
        "benchmark": "default job: this checkout against a baseline commit", "baseline_commit": commit,
        "epochs": args.epochs, "repeats": args.repeats, "runs": rows,
        "wall_ratio": stats([r["wall_ratio"] for r in rows]),
        "accuracy_points": stats([r["accuracy_points"] for r in rows]),
        "targets": {"accuracy_points_within": 0.3, "wall_ratio_within": [0.95, 1.05]},
    }
    w, a = result["wall_ratio"], result["accuracy_points"]
    print(f"\nwall ratio this / baseline: median {w['median']:.3f} (min {w['min']:.3f}, max {w['max']:.3f}); "
          f"accuracy: median {a['median']:+.2f} points (min {a['min']:+.2f}, max {a['max']:+.2f})")
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
