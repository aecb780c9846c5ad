"""Bytes through the busiest link under the ``edge`` preset: parameter servers against D-PSGD.

In the emulated network every process (worker or server) has one link to a switch; everything
it sends leaves over that link and everything it receives arrives over it. From the Transport's
per-peer counters in ``summary.json`` (``bytes_sent_per_peer``: row i, column j = bytes process
i sent to process j) this computes, for each process, the bytes out, the bytes in and their sum,
and reports the busiest link (the largest sum; also the largest single direction).

Configurations (4 workers, the default 1-D CNN on MNIST-1D, a short run):

- ``ps-1``: one parameter server: it receives every worker's gradient and answers every worker.
- ``ps-2``: two servers, each with half of the parameters: each server's link carries half.
- ``ps-2-nodes``: two servers and ``--workers-per-node 2``: only the 2 node leaders push.
- ``dpsgd-ring``: D-PSGD on a ring: each worker exchanges its model with 2 neighbours.

    python benchmarks/bench_busiest_link.py
    python benchmarks/bench_busiest_link.py --epochs 0.25

Byte counts do not depend on timing: each configuration runs ``--repeats`` times (3 by default)
and the results record the median, minimum and maximum of its busiest link's bytes, which must
agree (``checks.repeats_agree``).

Writes ``benchmarks/results/busiest_link.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import check_repeats, spread, write_result

from distrain.config import TrainConfig
from distrain.launch import launch_local

RESULTS = Path(__file__).resolve().parent / "results"

CONFIGS: dict[str, dict[str, Any]] = {
    "ps-1": {"algorithm": "ps", "servers": 1},
    "ps-2": {"algorithm": "ps", "servers": 2},
    "ps-2-nodes": {"algorithm": "ps", "servers": 2, "workers_per_node": 2},
    "dpsgd-ring": {"algorithm": "dpsgd", "topology": "ring"},
}


def link_loads(sent_per_peer: list[list[int]]) -> list[dict[str, int]]:
    """Bytes out, in, and both, through every process's link, from the per-peer send counters."""
    n = len(sent_per_peer)
    out = [sum(row) for row in sent_per_peer]
    into = [sum(sent_per_peer[i][j] for i in range(n)) for j in range(n)]
    return [{"out": o, "in": i, "total": o + i} for o, i in zip(out, into, strict=True)]


def run(name: str, settings: dict[str, Any], run_dir: Path, epochs: float, workers: int) -> dict[str, Any]:
    cfg = TrainConfig.from_dict({"network": "edge", "workers": workers, "epochs": epochs, "eval_every": 1000.0,
                                 "progress": False, "run_dir": str(run_dir), **settings}).validate()
    load = os.getloadavg()[0]
    summary = launch_local(cfg)
    loads = link_loads(summary["bytes_sent_per_peer"])
    busiest = max(range(len(loads)), key=lambda r: loads[r]["total"])
    role = "worker" if busiest < workers else "server"
    row = {"name": name, "settings": settings, "steps": summary["steps"], "links": loads,
           "busiest_process": busiest, "busiest_role": role,
           "busiest_link_bytes": loads[busiest]["total"],
           "busiest_direction_bytes": max(max(x["out"], x["in"]) for x in loads),
           "bytes_per_step": loads[busiest]["total"] / summary["steps"],
           "wall_time_s": summary["wall_time_s"], "load_before": load, "load_after": os.getloadavg()[0]}
    print(f"{name:12s} busiest link: {role} {busiest}, {row['busiest_link_bytes'] / 1e6:8.2f} MB "
          f"({row['bytes_per_step'] / 1e3:.1f} kB/step over {row['steps']} steps)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "busiest_link.json")
    args = parser.parse_args(argv)
    check_repeats(parser, args.repeats)
    rows, repeats = {}, {}
    with tempfile.TemporaryDirectory(prefix="distrain-busiest-link-") as tmp:
        for repeat in range(args.repeats):
            for name, settings in CONFIGS.items():
                rows[name] = run(name, settings, Path(tmp) / f"{name}-{repeat}", args.epochs, args.workers)
                repeats.setdefault(name, []).append(rows[name]["busiest_link_bytes"])
    for name, row in rows.items():
        row["busiest_link_bytes_repeats"] = spread(repeats[name])
    busiest = {name: spread(repeats[name])["median"] for name in rows}
    checks = {
        "ps_2_servers_below_1_server": busiest["ps-2"] < busiest["ps-1"],
        "dpsgd_below_ps_server": busiest["dpsgd-ring"] < busiest["ps-1"],
        "ratio_ps2_over_ps1": busiest["ps-2"] / busiest["ps-1"],
        "ratio_dpsgd_over_ps1": busiest["dpsgd-ring"] / busiest["ps-1"],
        "repeats_agree": all(len(set(v)) == 1 for v in repeats.values()),
    }
    result = {"benchmark": "bytes through the busiest link, edge preset", "workers": args.workers,
              "epochs": args.epochs, "network": "edge (20 Mbit/s, 10 ms; in-process link model)",
              "link": "a process's link to the switch: bytes it sends plus bytes it receives",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "checks": checks, "runs": rows}
    write_result(args.out, result)
    print(json.dumps(checks, indent=2))
    print(f"wrote {args.out}")
    return 0 if checks["ps_2_servers_below_1_server"] and checks["dpsgd_below_ps_server"] else 1


if __name__ == "__main__":
    sys.exit(main())
