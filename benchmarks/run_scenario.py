"""Run benchmark scenarios: each a ``distrain compare`` grid described by a small TOML file.

Results (comparison.json, comparison.csv, PNG plots) go to ``benchmarks/results/<scenario>/``;
the run directories under it are kept for ``distrain report`` but not committed (see
``benchmarks/results/.gitignore``). Extra ``distrain compare`` flags after ``--`` override the
scenario (e.g. ``-- --epochs 1`` for a quick look). Every configuration runs ``--repeats`` times
(3 by default, over the scenario's own ``repeats``); ``comparison.json`` then gains this run's
``provenance`` and, per configuration, ``speedup_per_repeat``: the median, minimum and maximum of
the per-repeat ratio baseline's time to target / this configuration's.

    python benchmarks/run_scenario.py benchmarks/scenarios/edge.toml
    python benchmarks/run_scenario.py benchmarks/scenarios/*.toml
    python benchmarks/run_scenario.py benchmarks/scenarios/lan.toml -- --epochs 1 --repeats 1   # a quick look

The same as ``distrain compare --scenario benchmarks/scenarios/edge.toml --out benchmarks/results/edge``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from provenance import check_repeats, ratio_spread, write_result

from distrain.cli import main as distrain_main
from distrain.compare import load_scenario

RESULTS = Path(__file__).resolve().parent / "results"


def add_per_repeat_speedups(comparison: dict[str, Any]) -> None:
    """Each configuration's per-repeat ratio of the baseline's time to target over its own."""
    def times(config: dict[str, Any]) -> list[float | None]:
        return [r.get("time_to_target_s") if r.get("status") == "ok" else None for r in config.get("runs", [])]

    baseline = next((c for c in comparison["configs"] if c["label"] == comparison.get("baseline")), None)
    for config in comparison["configs"]:
        if baseline is not None and config.get("runs") and len(times(config)) == len(times(baseline)):
            config["speedup_per_repeat"] = ratio_spread(times(baseline), times(config))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="+", type=Path, help="scenario files (benchmarks/scenarios/*.toml)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"results directory (default: {RESULTS})")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every configuration (a flag after -- wins)")
    args = parser.parse_args(argv)
    typed = [sys.argv[0], *argv, *(["--", *extra] if extra else [])]  # the command line, for the results
    if "--repeats" not in extra:
        check_repeats(parser, args.repeats)
        extra = ["--repeats", str(args.repeats), *extra]
    status = 0
    for path in args.scenarios:
        _, _, name = load_scenario(path)
        out = args.results / name
        print(f"=== scenario {name}: {path} -> {out}", flush=True)
        start = time.perf_counter()
        code = distrain_main(["compare", "--scenario", str(path), "--out", str(out), "--overwrite", *extra])  # replaces the last run
        print(f"=== scenario {name}: exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
        if (out / "comparison.json").exists() and code == 0:
            comparison = json.loads((out / "comparison.json").read_text())
            add_per_repeat_speedups(comparison)
            write_result(out / "comparison.json", comparison, argv=typed)
        status = status or code
        if code == 130:  # interrupted: stop here, not only this scenario
            break
    return status


if __name__ == "__main__":
    sys.exit(main())
