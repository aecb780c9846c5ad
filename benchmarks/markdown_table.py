"""Print a scenario's comparison (``comparison.json`` written by ``distrain compare``) as a Markdown table.

    python benchmarks/markdown_table.py benchmarks/results/edge        # the table in BENCHMARKS.md

Values are means over repeats, with [min-max] when there are several; speed-ups are against the
scenario's baseline configuration (the row marked "(baseline)") as ``distrain compare``
computed them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _value(stat: dict[str, Any] | None, scale: float, digits: int, repeats: int) -> str:
    if not stat or stat.get("mean") is None:
        return "not reached"
    mean = f"{stat['mean'] * scale:.{digits}f}"
    if repeats > 1 and stat["min"] != stat["max"]:
        return f"{mean} [{stat['min'] * scale:.{digits}f}–{stat['max'] * scale:.{digits}f}]"
    return mean


def table(comparison: dict[str, Any]) -> str:
    target = comparison.get("settings", {}).get("run", {}).get("target_accuracy")
    head = f"time to {target:.0%} (s)" if target else "time to target (s)"
    lines = [f"| configuration | final acc (%) | {head} | samples/s | MB sent/worker | speed-up (time to target) | "
             "speed-up (samples/s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    baseline = comparison.get("baseline")
    for row in comparison["configs"]:
        label = row["label"] + (" (baseline)" if row["label"] == baseline else "")
        if row["status"] == "skipped":
            continue
        if row["status"] != "ok":
            lines.append(f"| {label} | {row['status']} | | | | | |")
            continue
        n = row["repeats_ok"]
        time_to_target = row.get("time_to_target_s")
        reached = row.get("target_reached", 0)
        ttt = _value(time_to_target, 1, 1, n) if reached else "not reached"
        if reached and reached < n:
            ttt += f" ({reached}/{n} runs)"
        speed = row.get("speedup_time_to_target")
        lines.append("| " + " | ".join([
            label,
            _value(row["final_test_accuracy"], 100, 1, n),
            ttt,
            _value(row["samples_per_s"], 1, 0, n),
            _value(row["bytes_sent_per_worker"], 1e-6, 2, n),
            f"{speed:.2f}×" if speed else "–",
            f"{row['speedup_samples_per_s']:.2f}×" if row.get("speedup_samples_per_s") else "–",
        ]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results directories holding comparison.json")
    args = parser.parse_args()
    for path in args.results:
        comparison = json.loads((path / "comparison.json").read_text())
        print(f"<!-- {path}: {comparison.get('created', '')} -->")
        print(table(comparison))
        print()


if __name__ == "__main__":
    main()
