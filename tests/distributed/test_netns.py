"""Shaped network namespaces: a cluster is made, caps real TCP traffic, trains, and is always
removed (normal end, a killed worker, SIGTERM to the launcher, leftovers of a crashed run).

Needs root and iproute2; skipped otherwise, with the reason distrain gives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrain.emulation import NetworkSpec
from distrain.errors import ConfigError
from distrain.launch.netns import (
    NetnsCluster,
    TraceApplier,
    list_namespaces,
    netns_unavailable,
    require_netns,
)
from tests.reliability.common import wait_for

REASON = netns_unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces not permitted: {REASON}")

QUICK = ["--dataset", "synthetic", "--num-samples", "1200", "--model", "mlp", "--model-width", "32",
         "--batch-size", "16", "--no-progress", "--timeout", "60"]

SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while n < int(sys.argv[1]):
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5001)); c.sendall(b"x" * int(sys.argv[2])); c.close()
"""


def ours(pid: int) -> list[str]:
    """Namespaces and links made by process ``pid``."""
    links = [p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(f"dtr{pid}")]
    return [ns for ns in list_namespaces() if ns.startswith(f"distrain-{pid}-")] + links


def distrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "distrain", *args]


def test_without_permission_netns_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError) as exc:
        require_netns()
    assert exc.value.setting == "--emulation"
    assert exc.value.message.startswith("netns needs root and the ip command") and "\n" not in exc.value.message


@needs_netns
@pytest.mark.timeout(60)
def test_cluster_caps_real_tcp_traffic_and_is_removed():
    nbytes, bits = 1_000_000, 20e6
    with NetnsCluster(2, rates=[bits, None]) as cluster:
        assert ours(os.getpid())
        server = cluster.popen(1, [sys.executable, "-c", SERVER, str(nbytes)], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        client = cluster.popen(0, [sys.executable, "-c", CLIENT, cluster.addresses[1], str(nbytes)])
        assert client.wait(timeout=30) == 0
        received, seconds = server.stdout.readline().split()
        server.wait(timeout=10)
        assert int(received) == nbytes
        bound = nbytes * 8 / bits  # 0.4 s through worker 0's capped uplink
        assert 0.85 * bound <= float(seconds) <= 1.3 * bound, seconds
    assert ours(os.getpid()) == []


@needs_netns
@pytest.mark.timeout(60)
def test_bandwidth_trace_is_replayed_with_tc_change():
    from distrain.emulation import BandwidthTrace

    trace = BandwidthTrace.parse_csv("0,*,50mbit\n0.3,1,5mbit\n")
    spec = NetworkSpec(world=2, base_bandwidth=[None, None], schedules=trace.resolve(2), mode="netns")

    def rate(cluster: NetnsCluster, i: int) -> str:
        out = subprocess.run(["tc", "qdisc", "show", "dev", cluster.host_ends[i]], capture_output=True, text=True).stdout
        return out.split(" rate ")[1].split()[0] if " rate " in out else "none"

    with NetnsCluster(2, rates=[spec.bandwidth(r, 0) for r in range(2)]) as cluster:
        started = time.monotonic()
        applier = TraceApplier(cluster, spec).start()
        try:
            assert rate(cluster, 0) == rate(cluster, 1) == "50Mbit"
            wait_for(lambda: applier.changes > 0 or applier.error is not None, 10, "the trace's change at 0.3 s",
                     interval=0.01)
            assert time.monotonic() - started >= 0.3  # not before the trace says
            assert rate(cluster, 0) == "50Mbit" and rate(cluster, 1) == "5Mbit"
            assert applier.changes == 1 and applier.error is None
        finally:
            applier.stop()
    assert ours(os.getpid()) == []


@needs_netns
@pytest.mark.timeout(60)
def test_leftovers_of_a_dead_run_are_removed_at_the_next_start():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ns, bridge = f"distrain-{dead.pid}-0", f"dtr{dead.pid}b"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    try:
        with NetnsCluster(1):
            assert ours(dead.pid) == []
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@needs_netns
@pytest.mark.timeout(200)
def test_train_in_namespaces_counts_the_same_bytes_and_cleans_up(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(distrain_cmd("train", "--network", "edge", "--emulation", "netns", "--workers", "2",
                                         "--epochs", "1", "--run-dir", str(run), *QUICK),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert "final test accuracy" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["steps"] == 30
    for rank in range(2):  # the summary holds the Transport's counters, step by step in the metrics
        last = json.loads((run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()[-1])
        assert last["bytes_sent"] == summary["bytes_sent_per_worker"][rank] > 0
        assert last["bytes_received"] == summary["bytes_received_per_worker"][rank]
    assert sum(summary["bytes_sent_per_worker"]) == sum(summary["bytes_received_per_worker"])
    # edge: 10 ms per message; the small model's one bucket over 2 workers is one round of
    # recursive doubling (--ring auto), so at least 10 ms a step
    for rank in range(2):
        lines = [json.loads(x) for x in (run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert sum(m["comm_busy_s"] for m in lines) >= 30 * 0.010
    assert ours(proc.pid) == []


@needs_netns
@pytest.mark.slow  # `make test-all`: CI trains in namespaces (above) and in nodes (test_hierarchical.py)
@pytest.mark.timeout(200)
def test_a_node_is_one_namespace_and_its_workers_share_its_link(tmp_path):
    # 4 workers in nodes {0, 1}, {2, 3}: 2 namespaces; a server would get a third
    run = tmp_path / "run"
    proc = subprocess.Popen(distrain_cmd("train", "--network", "edge", "--emulation", "netns", "--workers", "4",
                                         "--workers-per-node", "2", "--epochs", "1", "--run-dir", str(run), *QUICK),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        names = _wait_for_namespaces(proc.pid, 2)
        deadline = time.monotonic() + 60
        while True:  # the launcher starts the workers one after the other
            members = [subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
                       for n in names]
            if all(len(m) >= 2 for m in members) or time.monotonic() > deadline or proc.poll() is not None:
                break
            time.sleep(0.05)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert all(len(m) >= 2 for m in members), members  # each namespace runs its node's 2 workers
    summary = json.loads((run / "summary.json").read_text())
    sent = summary["bytes_sent_per_worker"]
    assert sent[0] == sent[2] == 2 * sent[1] == 2 * sent[3] > 0  # leaders: to the other leader and to their member
    assert ours(proc.pid) == []


def _wait_for_namespaces(pid: int, n: int, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = sorted(x for x in ours(pid) if x.startswith("distrain-"))
        if len(names) == n:
            pids = subprocess.run(["ip", "netns", "pids", names[-1]], capture_output=True, text=True).stdout.split()
            if pids:
                return names
        time.sleep(0.1)
    raise AssertionError("the namespaces did not come up")


@needs_netns
@pytest.mark.slow  # `make test-all`
@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["kill-worker", "sigterm-launcher"])
def test_an_interrupted_run_leaves_nothing_behind(tmp_path, how):
    proc = subprocess.Popen(distrain_cmd("train", "--network", "wan", "--emulation", "netns", "--workers", "2",
                                         "--epochs", "50", "--run-dir", str(tmp_path / "run"), *QUICK),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        names = _wait_for_namespaces(proc.pid, 2)
        metrics = tmp_path / "run" / "metrics" / "rank1.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.1)  # until the workers are training (in collectives, not starting up)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if how == "kill-worker":
            worker = int(subprocess.run(["ip", "netns", "pids", names[1]], capture_output=True, text=True).stdout.split()[0])
            os.kill(worker, signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    if how == "kill-worker":
        assert "worker 1 exited with status -9" in err, err[-2000:]
    assert ours(proc.pid) == []
    for name in names:
        assert subprocess.run(["ip", "netns", "pids", name], capture_output=True).returncode != 0  # gone


@needs_netns
@pytest.mark.slow  # `make test-all`: the cap itself is checked in CI (test_cluster_caps_real_tcp_traffic_and_is_removed)
@pytest.mark.timeout(200)
def test_bench_link_in_namespaces_reaches_the_cap(tmp_path):
    from distrain.cli import main

    out = tmp_path / "link.json"
    assert main(["bench", "link", "--emulation", "netns", "--workers", "2", "--size", "2MB", "--bandwidth", "50mbit",
                 "--repeats", "2", "--timeout", "120", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for op in ("ring_allreduce_own", "ring_allreduce_gloo", "p2p"):
        r = result["results"][op]
        assert 0.8 <= r["utilisation"] <= 1.02, (op, r)  # tc really caps it, and we get most of it
    assert ours(os.getpid()) == []


LAUNCHED = """
import os, time, torch, distrain
torch.manual_seed(0)
model = torch.nn.Linear(500, 500)                       # 250,500 parameters: 1,002,000 bytes of gradient
opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), algorithm="allreduce")
x = torch.randn(8, 500)
model(x).sum().backward(); opt.step(); opt.zero_grad()  # a first step: buckets are built
before, t0 = opt.traffic()["bytes_sent"], time.perf_counter()
for _ in range(3):
    model(x).sum().backward(); opt.step(); opt.zero_grad()
print("RESULT", opt.rank, os.readlink("/proc/self/ns/net"), opt.traffic()["bytes_sent"] - before,
      time.perf_counter() - t0, flush=True)
opt.finish()
"""


@needs_netns
@pytest.mark.timeout(200)
def test_launch_runs_each_rank_of_a_script_in_a_capped_namespace_and_cleans_up(tmp_path):
    (tmp_path / "job.py").write_text(LAUNCHED)
    proc = subprocess.Popen(distrain_cmd("launch", "--workers", "2", "--emulation", "netns", "--bandwidth", "20mbit",
                                         "--latency", "1ms", "--timeout", "60", "job.py"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    results = {}
    for line in out.splitlines():
        if "RESULT" in line:
            rank, netns, sent, seconds = line.split("RESULT ", 1)[1].split()
            results[int(rank)] = (netns, int(sent), float(seconds))
    assert sorted(results) == [0, 1], out
    mine = os.readlink("/proc/self/ns/net")
    assert len({results[0][0], results[1][0], mine}) == 3  # each rank in a namespace of its own
    for _, sent, seconds in results.values():
        # a 2-worker ring all-reduce sends each worker's whole gradient once a step: 3 steps of ~1 MB
        assert sent == pytest.approx(3 * 1_002_000, rel=0.01)
        assert seconds >= 0.9 * sent * 8 / 20e6  # the cap held: no faster than 20 Mbit/s allows
    assert ours(proc.pid) == []
