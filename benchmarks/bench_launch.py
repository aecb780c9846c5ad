"""How long ``distrain launch`` takes to start a user's job, and to bring a lost rank back.

The same short job (``benchmarks/launch_job.py``: the MNIST-1D CNN through ``distrain.wrap()``,
4 workers) run with the ranks forked from the launcher's preloaded starter (the default) and
with ``--no-preload`` (a fresh ``python`` per rank, as torchrun starts them), alternating which
goes first in each repeat. Two cases:

- ``start``: 30 steps, no fault. ``ready_s``: from the launcher's start until every rank has
  taken its first step; ``wall_s``: until the launcher has exited.
- ``rejoin``: ``--max-restarts 1``, worker 2 killed (SIGKILL) as step 20 begins; the others go on
  until it has joined again. ``rejoin_s``: from the kill until its new life's ``wrap()`` returned
  with the members' state.

The figure for each measure is the median over repeats (5 by default, at least 3) of the
per-repeat ratio ``--no-preload`` / preloaded (above 1: the starter is faster), with its minimum
and maximum; the seconds of each side are recorded too.

    python benchmarks/bench_launch.py                 # 5 repeats
    python benchmarks/bench_launch.py --repeats 3

Writes ``benchmarks/results/launch.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, check_repeats, ratio_spread, write_result

RESULTS = Path(__file__).parent / "results"
JOB = Path(__file__).with_name("launch_job.py")
WORKERS, VICTIM, AT = 4, 2, 20
CASES = {"start": {"steps": 30, "victim": -1, "flags": []},
         "rejoin": {"steps": 30, "victim": VICTIM, "flags": ["--max-restarts", "1"]}}
MEASURES = {"start": ("ready_s", "wall_s"), "rejoin": ("rejoin_s", "wall_s")}


def run(case: str, preload: bool, timeout: float = 300) -> dict[str, float]:
    spec = CASES[case]
    with tempfile.TemporaryDirectory(prefix="distrain-bench-launch-") as out:
        command = [sys.executable, "-m", "distrain", "launch", "--workers", str(WORKERS), "--timeout", "60",
                   *spec["flags"], *([] if preload else ["--no-preload"]),
                   str(JOB), out, str(spec["steps"]), str(spec["victim"]), str(AT)]
        began = time.time()
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        ended = time.time()
        if done.returncode != 0:
            raise SystemExit(f"bench_launch: {case} ({'preloaded' if preload else '--no-preload'}) failed:\n"
                             f"{done.stderr[-3000:]}")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(WORKERS)]
    result = {"ready_s": max(r["first_step"] for r in ranks) - began, "wall_s": ended - began,
              "script_start_s": max(r["start"] for r in ranks) - began}
    if spec["victim"] >= 0:
        lost = ranks[spec["victim"]]
        result["rejoin_s"] = lost["joined"] - lost["killed"]
        result["restart_script_start_s"] = lost["restart"] - lost["killed"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "launch.json"))
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {c: {"preloaded": [], "fresh": []} for c in CASES}
    for repeat in range(args.repeats):
        for case in CASES:
            order = [True, False] if repeat % 2 == 0 else [False, True]
            for preload in order:
                got = run(case, preload)
                runs[case]["preloaded" if preload else "fresh"].append(got)
                print(f"repeat {repeat} {case:6s} {'preloaded' if preload else 'fresh':9s} "
                      + " ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    figures = {}
    for case, measures in MEASURES.items():
        for m in measures:
            fresh = [r[m] for r in runs[case]["fresh"]]
            pre = [r[m] for r in runs[case]["preloaded"]]
            figures[f"{case}.{m}"] = {"fresh_median_s": statistics.median(fresh),
                                      "preloaded_median_s": statistics.median(pre),
                                      "fresh_over_preloaded": ratio_spread(fresh, pre)}
            r = figures[f"{case}.{m}"]["fresh_over_preloaded"]
            print(f"{case}.{m}: fresh {statistics.median(fresh):.2f} s, preloaded {statistics.median(pre):.2f} s, "
                  f"ratio median {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f})", flush=True)
    path = write_result(args.out, {"workers": WORKERS, "repeats": args.repeats, "cases": CASES,
                                   "statistic": "median of per-repeat ratios --no-preload / preloaded",
                                   "figures": figures, "runs": runs})
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
