"""Run benchmark scenarios: each a ``distrain compare`` grid described by a small TOML file.

Results (comparison.json, comparison.csv, PNG plots) go to ``benchmarks/results/<scenario>/``;
the run directories under it are kept for ``distrain report`` but not committed (see
``benchmarks/results/.gitignore``). Extra ``distrain compare`` flags after ``--`` override the
scenario (e.g. ``-- --epochs 1`` for a quick look).

    python benchmarks/run_scenario.py benchmarks/scenarios/edge.toml
    python benchmarks/run_scenario.py benchmarks/scenarios/*.toml
    python benchmarks/run_scenario.py benchmarks/scenarios/lan.toml -- --repeats 3

The same as ``distrain compare --scenario benchmarks/scenarios/edge.toml --out benchmarks/results/edge``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from distrain.cli import main as distrain_main
from distrain.compare import load_scenario

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="+", type=Path, help="scenario files (benchmarks/scenarios/*.toml)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"results directory (default: {RESULTS})")
    args = parser.parse_args(argv)
    status = 0
    for path in args.scenarios:
        _, _, name = load_scenario(path)
        out = args.results / name
        print(f"=== scenario {name}: {path} -> {out}", flush=True)
        start = time.perf_counter()
        code = distrain_main(["compare", "--scenario", str(path), "--out", str(out), *extra])
        print(f"=== scenario {name}: exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
        status = status or code
        if code == 130:  # interrupted: stop here, not only this scenario
            break
    return status


if __name__ == "__main__":
    sys.exit(main())
