"""``distrain bench link``: how close our transfers come to the capacity of an emulated link.

Among N workers, each link capped at a bandwidth B (in-process link model, or ``tc`` in network
namespaces), it times a dense ring all-reduce of M bytes (our ring over point-to-point from
``comm/ring.py``, and gloo's own) and a point-to-point transfer of M bytes from worker 0 to
worker 1. For each it reports the median of the repeats (the slowest worker of each repeat,
after one warm-up), the lower bound, and the utilisation = bound / measured:

- ring all-reduce: each worker sends 2(n-1)/n * M bytes over its link, in 2(n-1) rounds:
  bound = 2(n-1)/n * M / B + 2(n-1) * latency;
- point-to-point: bound = M / B + latency.

Example::

    distrain bench link --bandwidth 100mbit --size 10MB --workers 4 --emulation netns
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distrain.emulation.units import format_bandwidth, parse_bandwidth, parse_duration, parse_size
from distrain.errors import ConfigError, WorkerFailure

log = logging.getLogger(__name__)

OPS = ("ring_allreduce_own", "ring_allreduce_gloo", "p2p")


@dataclass
class LinkBench:
    """What ``distrain bench link`` measures; bandwidth in bits/s, latency in seconds."""

    workers: int = 4
    size_bytes: int = 10_000_000
    bandwidth_bps: float = 100e6
    latency_s: float = 0.0
    emulation: str = "model"
    repeats: int = 5
    timeout_s: float = 300.0

    def validate(self) -> LinkBench:
        if not 2 <= self.workers <= 64:
            raise ConfigError("--workers", f"must be an integer from 2 to 64, got {self.workers!r}")
        if self.repeats < 1:
            raise ConfigError("--repeats", f"must be an integer >= 1, got {self.repeats!r}")
        if self.emulation not in ("model", "netns"):
            raise ConfigError("--emulation", f"unknown value {self.emulation!r}; choose one of: model, netns")
        if self.size_bytes < 4 * self.workers:
            raise ConfigError("--size", f"must be at least {4 * self.workers} bytes for {self.workers} workers")
        return self

    def bound(self, op: str) -> float:
        """The lower bound of ``op``'s time on an idle link of this bandwidth and latency."""
        n, bytes_per_s = self.workers, self.bandwidth_bps / 8
        nbytes = self.numel * 4
        if op == "p2p":
            return nbytes / bytes_per_s + self.latency_s
        return 2 * (n - 1) / n * nbytes / bytes_per_s + 2 * (n - 1) * self.latency_s

    @property
    def numel(self) -> int:
        return self.size_bytes // 4  # float32


# -- the parent: start the workers, collect, print -------------------------------------------

def run_link_bench(bench: LinkBench) -> dict[str, Any]:
    """Run the benchmark with ``bench.workers`` fresh processes; returns the results dict."""
    from distrain.launch.common import free_port
    from distrain.launch.netns import NetnsCluster, require_netns, stop_processes, supervise

    bench.validate()
    if bench.emulation == "netns":
        require_netns()
    with tempfile.TemporaryDirectory(prefix="distrain-bench-") as tmp:
        params = Path(tmp, "params.json")
        params.write_text(json.dumps(asdict(bench)))
        result_path = Path(tmp, "result.json")
        cluster = NetnsCluster(bench.workers, rates=[bench.bandwidth_bps] * bench.workers) if bench.emulation == "netns" else None
        procs: list[subprocess.Popen] = []
        logs = [Path(tmp, f"rank{r}.log") for r in range(bench.workers)]
        try:
            if cluster is not None:
                cluster.create()
            addr = cluster.addresses[0] if cluster is not None else "127.0.0.1"
            port = 29500 if cluster is not None else free_port()
            for r in range(bench.workers):
                env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(bench.workers), "MASTER_ADDR": addr,
                       "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
                if cluster is not None:
                    env["GLOO_SOCKET_IFNAME"] = cluster.interface
                    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
                argv = [sys.executable, "-m", "distrain.bench", str(params), str(result_path)]
                with open(logs[r], "wb") as out:
                    kw: dict[str, Any] = {"env": env, "stdout": out, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
                    if cluster is not None:
                        procs.append(cluster.popen(r, argv, **kw))
                    else:
                        procs.append(subprocess.Popen(argv, start_new_session=True, **kw))
            failures = supervise(procs, grace=10.0, timeout=bench.timeout_s)
            if failures:
                rank, code = failures[0]
                raise WorkerFailure(f"bench worker {rank} exited with status {code}:\n"
                                    + logs[rank].read_text(errors="replace")[-3000:])
            return json.loads(result_path.read_text())
        finally:
            stop_processes(procs)
            if cluster is not None:
                cluster.destroy()


def format_link_bench(result: dict[str, Any]) -> str:
    """The result table, for the terminal."""
    b = result["settings"]
    lines = [f"distrain bench link: {b['workers']} workers, {b['size_bytes'] / 1e6:g} MB, "
             f"{format_bandwidth(b['bandwidth_bps'])} per link, {b['latency_s'] * 1e3:g} ms latency, "
             f"emulation {b['emulation']}, median of {b['repeats']}",
             "",
             f"  {'operation':<22}{'sent/worker':>14}{'measured':>11}{'bound':>10}{'utilisation':>13}"]
    for op, r in result["results"].items():
        lines.append(f"  {op:<22}{r['bytes_sent_per_worker'] / 1e6:>11.2f} MB{r['seconds']:>10.3f}s"
                     f"{r['lower_bound_s']:>9.3f}s{r['utilisation']:>13.3f}")
    return "\n".join(lines)


def default_out(bench: LinkBench) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / "bench" / f"link-{bench.emulation}-{bench.workers}w-{stamp}.json"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``distrain bench link``: attach the parsers to the CLI's subcommands."""
    bench = sub.add_parser("bench", help="measure communication under an emulated network",
                           description="Benchmarks of distrain's communication.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=type(bench))
    link = bench_sub.add_parser("link", help="ring all-reduce and point-to-point against a link's bound",
                                description=__doc__.split("\n\n")[1].replace("\n", " "))
    defaults = LinkBench()
    link.add_argument("--workers", type=int, default=defaults.workers, help="worker processes (default: 4)")
    link.add_argument("--size", default="10MB", help="bytes per transfer, e.g. 10MB, 512KiB (default: 10MB)")
    link.add_argument("--bandwidth", default="100mbit", help="every worker's link, e.g. 100mbit (default: 100mbit)")
    link.add_argument("--latency", default="0ms", help="one-way latency per message, in-process model (default: 0ms)")
    link.add_argument("--emulation", default="model", choices=("model", "netns"),
                      help="in-process link model, or tc-shaped network namespaces (root) (default: model)")
    link.add_argument("--repeats", type=int, default=defaults.repeats, help="timed repeats after one warm-up (default: 5)")
    link.add_argument("--timeout", type=float, default=defaults.timeout_s, help="seconds before giving up (default: 300)")
    link.add_argument("--out", default=None, metavar="FILE",
                      help="JSON results file (default: runs/bench/link-<emulation>-<N>w-<time>.json)")
    link.set_defaults(func=cmd_bench_link)


def cmd_bench_link(args: argparse.Namespace) -> int:
    bench = LinkBench(workers=args.workers, size_bytes=parse_size(args.size, "--size"),
                      bandwidth_bps=parse_bandwidth(args.bandwidth, "--bandwidth"),
                      latency_s=parse_duration(args.latency, "--latency"), emulation=args.emulation,
                      repeats=args.repeats, timeout_s=args.timeout).validate()
    result = run_link_bench(bench)
    out = Path(args.out) if args.out else default_out(bench)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_link_bench(result))
    print(f"\nresults: {out}")
    return 0


# -- a worker --------------------------------------------------------------------------------

def _worker(params_path: str, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    from distrain.comm import Transport, ring_all_reduce
    from distrain.emulation import LinkModel, NetworkSpec

    bench = LinkBench(**json.loads(Path(params_path).read_text()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=bench.timeout_s))
    shaped = bench.bandwidth_bps if bench.emulation == "model" else None  # netns: tc shapes it
    model = LinkModel(NetworkSpec.uniform(world, shaped, bench.latency_s, mode=bench.emulation), rank)
    transport = Transport(link_model=model)
    data = torch.ones(bench.numel)

    def p2p() -> None:
        if rank == 0:
            transport.send(data, 1).wait()
        elif rank == 1:
            transport.recv(data, 0).wait()

    ops = {"ring_allreduce_own": lambda: ring_all_reduce(transport, data),
           "ring_allreduce_gloo": lambda: transport.all_reduce(data).wait(), "p2p": p2p}
    results = {}
    for name in OPS:
        seconds, sent = [], 0
        for repeat in range(bench.repeats + 1):
            transport.control_barrier()
            model.start()  # empty links for every repeat
            before = transport.stats.bytes_sent
            t0 = time.perf_counter()
            ops[name]()
            mine = torch.tensor([time.perf_counter() - t0, transport.stats.bytes_sent - before], dtype=torch.float64)
            rows = transport.control_all_gather(mine)
            if repeat:  # the first is a warm-up (connections, allocations)
                seconds.append(max(float(r[0]) for r in rows))
                sent = max(int(r[1]) for r in rows)
        bound = bench.bound(name)
        median = statistics.median(seconds)
        results[name] = {"bytes": bench.numel * 4, "bytes_sent_per_worker": sent, "seconds": median,
                         "seconds_all": seconds, "lower_bound_s": bound, "utilisation": bound / median}
    transport.close()
    if rank == 0:
        Path(result_path).write_text(json.dumps({
            "settings": asdict(bench), "results": results, "machine": os.uname().nodename,
            "torch": torch.__version__, "time": datetime.datetime.now().isoformat(timespec="seconds")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
