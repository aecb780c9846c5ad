"""``distrain launch`` on several machines (``--nnodes``), as two launchers on this one: node 0's
serves the rendezvous on 127.0.0.1; a failure on one node stops the other's processes; in an
elastic run a node lost outright (its launcher killed) leaves the other going on, and started
again with ``--join`` its workers enter the run with the members' state, not a checkpoint's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from distrain.launch.common import free_port
from tests.distributed.test_elastic import WORKERS
from tests.distributed.test_elastic import absent_reference as reference
from tests.reliability.common import cli_env, kill_tagged, tagged

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).parents[2]
SCRIPT = Path(__file__).with_name("elastic_script.py")
PER_NODE, NODES, STEPS = 2, 2, 8
assert PER_NODE * NODES == WORKERS  # the references count the workers of test_elastic's runs


def node(rank: int, port: int, tag: str, args: list[str], *flags: str) -> subprocess.Popen:
    """Node ``rank``'s launcher: ``distrain launch --nnodes 2 --node-rank RANK``."""
    command = [sys.executable, "-m", "distrain", "launch", "--nnodes", str(NODES), "--node-rank", str(rank),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--workers", str(PER_NODE),
               "--timeout", "60", *flags, *args]
    return subprocess.Popen(command, env=cli_env(tag), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 100) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


# CI: the node failure test below, and test_elastic.py's joins (the same admission, one node)
@pytest.mark.slow
def test_a_lost_node_joins_again_with_the_others_state(tmp_path: Path):
    """Node 1 (workers 2 and 3) is lost as step 3 begins: worker 2 kills its launcher, and worker 3
    dies with it. Node 0's workers redo step 3 without them and go on. Node 1 started again with
    --join: its workers are admitted at a step's end with the members' parameters and momentum,
    and from then on their gradients count again. Every worker ends on the reference computed
    from the steps each worker was in."""
    tag, port, at = uuid.uuid4().hex, free_port(), 3
    args = [str(SCRIPT), str(tmp_path), str(STEPS), "2", str(at), "node"]
    try:
        first = node(0, port, tag, args)
        second = node(1, port, tag, args)
        code, err = finish(second, timeout=60)
        assert code == -9, err  # killed outright, and its workers with it
        back = node(1, port, tag, args, "--join")
        code, err = finish(back)
        assert code == 0, err
        code, err0 = finish(first)
        assert code == 0, err0
        assert tagged(tag) == []  # nothing left running
    finally:
        kill_tagged(tag)
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(PER_NODE * NODES)}
    changes = results[0]["changes"]
    lost = [c for c in changes if c["event"] == "lost"]
    joined = [c for c in changes if c["event"] == "joined"]
    assert sorted(w for c in lost for w in c["workers"]) == [2, 3] and all(c["lost_at_step"] == at for c in lost)
    assert lost[-1]["members"] == [0, 1]
    assert sorted(w for c in joined for w in c["workers"]) == [2, 3] and joined[-1]["members"][:2] == [0, 1]
    absent = {w: (at, c["joined_at_step"]) for c in joined for w in c["workers"]}
    steps = results[0]["steps"]
    assert steps == max(STEPS, joined[-1]["joined_at_step"] + 4)
    expected = reference(absent, steps)
    for r, result in results.items():
        assert result["workers"] == PER_NODE * NODES and result["steps"] == steps, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=1e-12, atol=1e-12)
    # the reference can fail: without the joiners' gradients, or with theirs kept at step 3, it differs
    assert not torch.allclose(reference({2: (at, steps), 3: (at, steps)}, steps), expected)
    assert not torch.allclose(reference({w: (at + 1, b) for w, (_, b) in absent.items()}, steps), expected)


def test_a_failure_on_one_node_stops_the_other_and_is_named(tmp_path: Path):
    """Rank 3 (node 1) fails; node 0's ranks would wait for it in a collective: node 0's launcher
    learns of the failure from the rendezvous, stops them and names it; nothing is left running.
    Rank 3 drops its connections before it fails, so node 0's ranks fail first, for want of it:
    node 0's launcher still names rank 3's failure as the cause, not its own ranks'."""
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import time, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 3:
            dist.destroy_process_group()
            time.sleep(1.0)  # node 0's ranks have failed by now
            raise RuntimeError("boom on purpose")
        dist.barrier()
    """))
    tag, port = uuid.uuid4().hex, free_port()
    try:
        procs = [node(n, port, tag, [str(tmp_path / "job.py")]) for n in range(NODES)]
        (code0, err0), (code1, err1) = (finish(p, timeout=60) for p in procs)
        assert tagged(tag) == []
    finally:
        kill_tagged(tag)
    assert code1 == 1 and err1.strip().splitlines()[-1] == \
        "distrain: rank 3 failed: RuntimeError: boom on purpose (exit status 1)", err1
    assert code0 == 1 and "node 1: rank 3 failed" in err0.strip().splitlines()[-1], err0
