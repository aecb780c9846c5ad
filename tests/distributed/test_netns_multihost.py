"""Two hosts, emulated as two network namespaces with their own addresses on a capped bridge,
each running ``torchrun --nnodes 2 --nproc-per-node 2`` with c10d rendezvous, train together.

This mirrors the real two-machine command in the README; needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distrain.launch.common import free_port
from distrain.launch.netns import NetnsCluster, netns_unavailable
from tests.distributed.test_netns import QUICK, ours

REASON = netns_unavailable()


def uplink_bytes(cluster: NetnsCluster, host: int) -> int:
    out = subprocess.run(["tc", "-s", "-n", cluster.namespaces[host], "qdisc", "show", "dev", cluster.interface],
                         capture_output=True, text=True).stdout
    return int(out.split(" Sent ")[1].split()[0])


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces not permitted: {REASON}")
@pytest.mark.timeout(240)
@pytest.mark.slow  # CI: test_netns.py trains in namespaces
def test_two_hosts_under_torchrun_train_together(tmp_path):
    run = tmp_path / "two-hosts"
    procs: list[subprocess.Popen] = []
    with NetnsCluster(2, rates=[100e6, 100e6]) as cluster:
        port = free_port()  # any port works inside a fresh namespace; a free one keeps it readable
        for host in range(2):
            # is_host: both namespaces share this machine's host name, so torchrun cannot tell
            # by name which one should serve the rendezvous store; on real machines it can.
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addresses[0]}:{port}", "--rdzv-id", "two-hosts",
                    "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", cluster.addresses[host],
                    "-m", "distrain", "train", "--run-dir", str(run), "--epochs", "1", "--latency", "1ms", *QUICK]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": cluster.interface, "TORCH_CPP_LOG_LEVEL": "ERROR"}
            procs.append(cluster.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            outputs = [p.communicate(timeout=200)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, out in zip(procs, outputs, strict=True):
            assert p.returncode == 0, out[-3000:]
        crossed = [uplink_bytes(cluster, host) for host in range(2)]
    assert ours(os.getpid()) == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["steps"] == 15
    for rank in range(4):
        last = json.loads((run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()[-1])
        assert last["bytes_sent"] == summary["bytes_sent_per_worker"][rank] > 0
    # Gradients crossed between the hosts through their capped links: each all-reduce moves at
    # least a quarter of the gradient bytes from one host to the other.
    per_step = summary["bytes_sent_per_worker"][0] / summary["steps"]
    assert min(crossed) >= summary["steps"] * per_step / 4, (crossed, per_step)
