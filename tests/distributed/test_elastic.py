"""Elastic all-reduce: a worker killed outright (SIGKILL), rank 0 included, and the others go on.

A user's script (``elastic_script.py``) runs through ``distrain launch --workers 4``. Each worker's
gradient at each step is a known vector, so the test computes what the survivors must hold: the
steps before the loss average all four workers' gradients, the interrupted step and those after
it average the survivors' only (no step lost, none applied twice), under SGD with momentum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.distributed.elastic_script import gradient

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).with_name("elastic_script.py")
WORKERS, STEPS = 4, 8


def absent_reference(absent: dict[int, tuple[int, int]], steps: int, lr: float = 0.1,
                     momentum: float = 0.9, start: float = 0.0) -> torch.Tensor:
    """The weights after ``steps`` steps of SGD with momentum on the mean of the live workers'
    gradients, worker ``w`` absent from step ``absent[w][0]`` until step ``absent[w][1]``, from
    weights all ``start``."""
    w = torch.full((gradient(0, 0).numel(),), start, dtype=torch.float64)
    buf = None
    for step in range(steps):
        live = [r for r in range(WORKERS) if not (r in absent and absent[r][0] <= step < absent[r][1])]
        g = torch.stack([gradient(r, step) for r in live]).mean(0)
        buf = g.clone() if buf is None else momentum * buf + g
        w = w - lr * buf
    return w


def reference(victim: int, at: int, back: int | None = None, steps: int = STEPS, lr: float = 0.1,
              momentum: float = 0.9) -> torch.Tensor:
    """:func:`absent_reference` with ``victim`` absent from step ``at`` until step ``back`` (None: never)."""
    return absent_reference({victim: (at, steps if back is None else back)}, steps, lr, momentum)


def launch(out: Path, victim: int, at: int, where: str, *flags: str,
           settings: dict | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the script through ``distrain launch --workers 4`` with ``flags`` (and the script's
    wrap() ``settings``; ``env``: the launcher's environment)."""
    command = [sys.executable, "-m", "distrain", "launch", "--workers", str(WORKERS), "--timeout", "60", *flags,
               str(SCRIPT), str(out), str(STEPS), str(victim), str(at), where, *([json.dumps(settings)] if settings else [])]
    return subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=Path(__file__).parents[2], env=env)


def kill_in(tmp_path: Path, phase: str, worker: int, **extra: str) -> dict:
    """The launcher's environment with worker ``worker`` killed in ``phase`` of a membership change
    (``DISTRAIN_INJECT_KILL_IN``)."""
    return {**os.environ, "DISTRAIN_INJECT_KILL_IN": f"{phase}:{worker}",
            "DISTRAIN_INJECT_MARK": str(tmp_path / "mark"), **extra}


def launch_tagged(tmp_path: Path, victim: int, at: int, where: str, *flags: str, settings: dict | None = None,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`launch`, checking that nothing of the run is left running once it ends (its
    processes are tagged; any found are killed)."""
    from tests.reliability.common import kill_tagged, tagged

    # (the session's directory too: pytest cuts tmp_path's name to 30 characters, and another
    # pytest session's test of a like name would otherwise find, and kill, this run's processes)
    tag = f"rejoin-{tmp_path.parent.name}-{tmp_path.name}"
    try:
        done = launch(tmp_path, victim, at, where, *flags, settings=settings,
                      env={**(os.environ if env is None else env), "DISTRAIN_TEST_TAG": tag})
        assert tagged(tag) == []
    finally:
        kill_tagged(tag)
    return done


def lost_as_it_enters(tmp_path: Path, joined: list[int], *flags: str,
                      settings: dict | None = None) -> tuple[subprocess.CompletedProcess, dict[int, dict], int, int]:
    """Worker 0 killed as step 3 begins, started again, killed again once admitted (``entry``) and
    started a third time (``--max-restarts 2``; ``flags`` besides): the run's process, every
    worker's result, the step of the join that held and the run's steps, once every member
    recorded the loss, the join the second loss undid, and the join that held (the members in
    the order ``joined``)."""
    done = launch_tagged(tmp_path, 0, 3, "rejoin", *flags, "--max-restarts", "2", settings=settings,
                         env=kill_in(tmp_path, "entry", 0, ELASTIC_FULL="1"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mark").exists()
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}
    events = [(c["event"], c["workers"], c["members"]) for c in results[1]["changes"]]
    assert events == [("lost", [0], [1, 2, 3]), ("joined", [0], joined), ("lost", [0], [1, 2, 3]),
                      ("joined", [0], joined)], events
    back = results[1]["changes"][-1]["joined_at_step"]
    steps = max(STEPS, back + 4)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["steps"] == steps, r
    return done, results, back, steps


def rejoin(tmp_path: Path, victim: int, at: int,
           settings: dict | None = None) -> tuple[subprocess.CompletedProcess, dict[int, dict], int, dict, dict]:
    """Kill worker ``victim`` as step ``at`` begins and start it again (``--max-restarts 1``): the
    run's process, every worker's result, the run's steps, and its lost and joined changes."""
    done = launch(tmp_path, victim, at, "rejoin", "--max-restarts", "1", settings=settings)
    assert done.returncode == 0, done.stderr
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}
    lost, joined = results[min(r for r in range(WORKERS) if r != victim)]["changes"]  # a member's record
    return done, results, results[0]["steps"], lost, joined


# CI: the join test below loses worker 0 first and checks the survivors' steps against the same reference
@pytest.mark.slow
@pytest.mark.parametrize("victim,where", [(0, "start"), (2, "backward")])
def test_survivors_redo_the_interrupted_step_without_the_lost_worker(tmp_path: Path, victim: int, where: str):
    at = 3
    done = launch(tmp_path, victim, at, where)
    assert done.returncode == 0, done.stderr
    assert f"rank {victim} failed: killed by SIGKILL; the others go on without it" in done.stderr
    survivors = sorted(set(range(WORKERS)) - {victim})
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in survivors}
    assert not (tmp_path / f"worker{victim}.pt").exists()
    expected = reference(victim, at)
    if where == "backward":  # its all-reduce had started: if a survivor finished that step with the lost
        # worker's gradient before the loss showed, every survivor takes that survivor's state instead
        first = results[survivors[0]]["weight"].reshape(-1)
        if not torch.allclose(first, expected, rtol=0, atol=1e-12):
            expected = reference(victim, at + 1)
    for r, result in results.items():
        assert result["workers"] == WORKERS - 1 and result["ids"] == survivors, r
        assert result["steps"] == STEPS, r
        [change] = result["changes"]
        assert change["workers"] == [victim] and change["members"] == survivors and change["lost_at_step"] in ((at,) if where == "start" else (at, at + 1))
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    # the reference can fail: with the lost worker's gradient kept in the interrupted step it differs
    assert not torch.allclose(reference(victim, at + 1), expected)


#: Compressed all-reduce: top-2 of the 10 gradient values with error feedback, from the first
#: step (no density warm-up), momentum left in the optimizer (no momentum correction).
TOPK = {"compress": "topk:0.2", "density_warmup_epochs": 0, "density_decay_epochs": 0,
        "momentum_correction": "off"}


def topk_reference(victim: int, at: int, steps: int = STEPS, lr: float = 0.1, momentum: float = 0.9,
                   twice: bool = False, back: int | None = None) -> torch.Tensor:
    """The weights after ``steps`` steps of SGD with momentum on the mean of the live workers'
    top-k payloads, each worker keeping what it did not send (error feedback), ``victim`` absent
    from step ``at`` (until step ``back``, when it joins with an empty residual). ``twice``: the
    survivors' residuals take step ``at``'s gradient twice (its compression done again on top of
    the interrupted one's)."""
    from distrain.compress import CompressInfo, build_compressor

    feedback = {r: build_compressor(TOPK["compress"]) for r in range(WORKERS)}
    w = torch.zeros(gradient(0, 0).numel(), dtype=torch.float64)
    buf = None
    for step in range(steps):
        if step == back:
            feedback[victim] = build_compressor(TOPK["compress"])
        live = [r for r in range(WORKERS) if not (r == victim and at <= step < (steps if back is None else back))]
        sent = []
        for r in live:
            info = CompressInfo(step=step, key=0, ratio=0.2, worker=r)
            if twice and step == at:
                feedback[r].compress(gradient(r, step), info)
            payload, ctx = feedback[r].compress(gradient(r, step), info)
            sent.append(feedback[r].decompress(payload, ctx))
        g = torch.stack(sent).sum(0) / len(live)
        buf = g.clone() if buf is None else momentum * buf + g
        w = w - lr * buf
    return w


@pytest.mark.slow  # CI: the join test below loses worker 0 and redoes its step uncompressed
def test_compressed_survivors_redo_the_step_from_their_residuals_before_it(tmp_path: Path):
    """Top-k with error feedback: worker 0 killed as step 3 begins; each survivor redoes step 3
    from the residual it held before compressing it, so no gradient is sent twice or lost."""
    victim, at = 0, 3
    done = launch(tmp_path, victim, at, "start", settings=TOPK)
    assert done.returncode == 0, done.stderr
    assert f"rank {victim} failed: killed by SIGKILL; the others go on without it" in done.stderr
    survivors = [1, 2, 3]
    expected = topk_reference(victim, at)
    for r in survivors:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["workers"] == WORKERS - 1 and result["ids"] == survivors and result["steps"] == STEPS, r
        [change] = result["changes"]
        assert change["workers"] == [victim] and change["lost_at_step"] == at
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(topk_reference(victim, at, twice=True), expected)  # a residual that kept the first try
    assert not torch.allclose(reference(victim, at), expected)  # the compression is in it


@pytest.mark.slow  # CI: the uncompressed join below
def test_a_restarted_worker_joins_compressed_all_reduce_with_an_empty_residual(tmp_path: Path):
    """--max-restarts 1 under top-k with error feedback: worker 2, killed at step 3, joins at a
    step's end with the others' parameters and momentum and an empty residual of its own."""
    victim, at = 2, 3
    done, results, steps, lost, joined = rejoin(tmp_path, victim, at, TOPK)
    assert lost["workers"] == [victim] and joined["workers"] == [victim]
    back = joined["joined_at_step"]
    assert at < back and steps == max(STEPS, back + 4)
    expected = topk_reference(victim, at, steps, back=back)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["steps"] == steps, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(topk_reference(victim, at, steps), expected)  # the joiner's payloads count


@pytest.mark.slow  # distrain train's case (test_lost_peer.py) runs in CI
def test_min_workers_stops_the_run_with_one_line(tmp_path: Path):
    done = launch(tmp_path, 1, 3, "start", "--min-workers", str(WORKERS))
    assert done.returncode == 1
    assert "rank 1 failed: killed by SIGKILL" in done.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.glob("worker*.pt"))


def test_a_restarted_worker_joins_with_the_others_state(tmp_path: Path):
    """--max-restarts 1: worker 0, killed at step 3, is started again and joins the others at a step's
    end, with their parameters and momentum; from then on its gradient counts again. Until then the
    survivors redid step 3 and went on with their own gradients only."""
    at = 3
    done, results, steps, lost, joined = rejoin(tmp_path, 0, at)
    assert "rank 0 failed: killed by SIGKILL; started again, it joins the others with their state" in done.stderr
    assert lost["event"] == "lost" and lost["workers"] == [0] and lost["lost_at_step"] == at
    assert lost["members"] == [1, 2, 3]
    assert joined["event"] == "joined" and joined["workers"] == [0] and joined["members"] == [1, 2, 3, 0]
    back = joined["joined_at_step"]
    assert at < back and steps == max(STEPS, back + 4)
    expected = reference(0, at, back, steps)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["steps"] == steps, r
        assert result["changes"][-1]["members"] == [1, 2, 3, 0] and result["changes"][-1]["joined_at_step"] == back
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(reference(0, at, None, steps), expected)  # the joiner's gradients count
    assert not torch.allclose(reference(0, at + 1, back, steps), expected)  # the survivors redid step 3 without it


def test_a_hung_worker_is_left_behind_at_once_and_removed_as_the_others_finish(tmp_path: Path):
    """Worker 2 stops (SIGSTOP) as step 3 begins: alive, its connections open, silent. The script
    made its optimizer before ``wrap()`` (as every user's does, importing ``torch._dynamo`` before
    the group opened): the survivors replace their group within a second of agreeing on the loss
    (not after gloo's freed group has waited out the 60 s --timeout on the silent peer), finish
    with the reference's parameters, and the launcher removes the stopped worker as they finish
    (it would not answer SIGTERM), with one line and exit status 0."""
    at = 3
    done = launch_tagged(tmp_path, 2, at, "hang")
    assert done.returncode == 0, done.stderr
    assert "rank 2 was left behind by the others (silent past their deadline) and still ran as they finished; " \
           "stopped it" in done.stderr
    survivors = [0, 1, 3]
    for r in survivors:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["ids"] == survivors and result["steps"] == STEPS, r
        [change] = result["changes"]
        assert change["workers"] == [2] and change["members"] == survivors and change["lost_at_step"] == at
        assert change["recovery_s"] < 3.0, change  # (57 s when the old group was freed)
        torch.testing.assert_close(result["weight"].reshape(-1), reference(2, at), rtol=0, atol=1e-12)
    assert not (tmp_path / "worker2.pt").exists()


def test_a_worker_killed_before_wrap_is_left_out_and_the_others_open_their_group_without_it(tmp_path: Path):
    """No restarts: worker 0 dies before its ``wrap()`` (as a script dies loading its data). The
    others do not wait for it in a group's rendezvous: once they open their group, the launcher
    declares it dead, and they open it without it and train from step 0 as three, each on the
    reference without worker 0, the loss recorded at step 0; one line, exit status 0."""
    done = launch_tagged(tmp_path, 0, 0, "wrap")
    assert done.returncode == 0, done.stderr
    assert ("rank 0 failed: killed by SIGKILL before it opened the group with the others; the others go on "
            "without it") in done.stderr
    survivors, expected = [1, 2, 3], absent_reference({0: (0, STEPS)}, STEPS)
    for r in survivors:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["ids"] == survivors and result["steps"] == STEPS, r
        [change] = result["changes"]
        assert change["workers"] == [0] and change["members"] == survivors and change["lost_at_step"] == 0, change
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not (tmp_path / "worker0.pt").exists()


def test_rank_0_lost_as_it_hands_out_its_parameters_leaves_the_others_starting_from_the_next_ones(tmp_path: Path):
    """Worker 0 dies as ``wrap()`` begins to hand its parameters to the others (each worker
    started at its own rank's weights). The others agree without it and start from the new
    rank 0's (worker 1's) parameters, all alike: every survivor ends on the reference without
    worker 0 from weights all 1, which a survivor that kept its own start would not."""
    env = {**kill_in(tmp_path, "start-broadcast", 0), "ELASTIC_INIT": "rank"}
    done = launch_tagged(tmp_path, -1, 0, "none", env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mark").exists()  # worker 0 died where asked
    survivors = [1, 2, 3]
    expected = absent_reference({0: (0, STEPS)}, STEPS, start=1.0)
    for r in survivors:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["ids"] == survivors and result["steps"] == STEPS, r
        assert [c["workers"] for c in result["changes"]] == [[0]], result["changes"]
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(absent_reference({0: (0, STEPS)}, STEPS, start=2.0), expected)


# `make test-all`: the joins of every family stay in CI; this is the case of a worker lost before wrap() opened its group
@pytest.mark.slow
def test_a_worker_killed_before_wrap_is_started_again_in_its_place(tmp_path: Path):
    """--max-restarts 1: worker 2 dies before its ``wrap()`` (as a script dies loading its data).
    Nobody waits for it in a run yet: once the others begin to open the group, the launcher
    starts it again in its place, as it was started first, and the run is the four workers' from
    step 0, with no change of members: every worker on the reference with all four gradients."""
    done = launch_tagged(tmp_path, 2, 0, "wrap", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "killed-before-wrap").exists()
    assert ("rank 2 failed: killed by SIGKILL before it opened the group with the others; started again in its "
            "place") in done.stderr
    expected = absent_reference({}, STEPS)
    for r in range(WORKERS):
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["workers"] == WORKERS and result["steps"] == STEPS and result["changes"] == [], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(reference(2, 0), expected)  # its gradients count from the first step


@pytest.mark.slow  # CI: the join test above
@pytest.mark.parametrize("phase", ["admission", "handover"])
def test_a_member_lost_while_a_worker_joins_leaves_the_others_and_the_joiner_going(tmp_path: Path, phase: str):
    """Worker 0, killed at step 3, is started again; as the members admit it, worker 2 dies: before
    the group with the joiner opens (``admission``) or once it is open, before the joiner took
    their state (``handover``). The others agree again without worker 2, the joiner among them,
    and it takes a member's state there: no wait for the dead one's rendezvous, nothing redone
    twice; every survivor ends on the reference with worker 0 absent from step 3 until its join
    and worker 2 from then on."""
    at = 3
    done = launch(tmp_path, 0, at, "rejoin", "--max-restarts", "1", env=kill_in(tmp_path, phase, 2))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mark").exists()  # worker 2 died where asked
    assert not (tmp_path / "worker2.pt").exists()
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in (0, 1, 3)}
    lost, joined, lost2 = results[1]["changes"]
    assert lost["workers"] == [0] and lost["lost_at_step"] == at and lost["members"] == [1, 2, 3]
    back = joined["joined_at_step"]
    assert joined["workers"] == [0] and joined["members"] == [1, 2, 3, 0] and at < back
    assert lost2["event"] == "lost" and lost2["workers"] == [2] and lost2["members"] == [1, 3, 0]
    assert lost2["lost_at_step"] == back and lost2["membership_epoch"] == joined["membership_epoch"] + 1
    assert [c["event"] for c in results[0]["changes"]] == ["joined", "lost"]  # the joiner saw both
    steps = max(STEPS, back + 4)
    expected = absent_reference({0: (at, back), 2: (back, steps)}, steps)
    for r, result in results.items():
        assert result["workers"] == 3 and result["ids"] == [1, 3, 0] and result["steps"] == steps, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(absent_reference({0: (at, back)}, steps), expected)  # worker 2's loss counts


# CI: the rendezvous case; `make test-all`: the agreement's too
@pytest.mark.parametrize("phase", [pytest.param("recovery", marks=pytest.mark.slow), "meet"])
def test_a_survivor_lost_as_the_survivors_regroup_leaves_the_others_going(tmp_path: Path, phase: str):
    """Worker 0 killed as step 3 begins; worker 2 dies once the survivors agreed on [1, 2, 3],
    before their group opened (``recovery``), or once all three were ready to open it, before
    its rendezvous (``meet``): the other two see it gone instead of waiting in the group's
    rendezvous (for the run's timeout, 60 s, or the opening's bound, 13 s, which ``meet`` took
    before the rendezvous's waits looked for the lost), agree again on [1, 3] and redo step 3
    between themselves."""
    at = 3
    done = launch(tmp_path, 0, at, "start", env=kill_in(tmp_path, phase, 2))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mark").exists()
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in (1, 3)}
    expected = absent_reference({0: (at, STEPS), 2: (at, STEPS)}, STEPS)
    for r, result in results.items():
        first, second = result["changes"]
        assert (first["workers"], first["members"], second["workers"], second["members"]) == ([0], [1, 2, 3], [2], [1, 3])
        assert second["unix_time"] - first["unix_time"] < 6, (first, second)  # not the rendezvous's 13 or 60 s
        assert result["workers"] == 2 and result["steps"] == STEPS, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)


@pytest.mark.slow  # CI: the all-reduce case above
def test_a_member_lost_while_a_worker_joins_gossip_leaves_the_joiner_with_a_members_model(tmp_path: Path):
    """D-PSGD: worker 2 dies once the group with the joiner (worker 0, killed at step 3) is open,
    before the joiner took a model: the survivors and the joiner agree again, the joiner takes
    the first member's model and momentum, and the three average their models (the same model,
    on the complete graph) and go on."""
    at = 3
    done = launch(tmp_path, 0, at, "rejoin", "--max-restarts", "1", settings=GOSSIP, env=kill_in(tmp_path, "handover", 2))
    assert done.returncode == 0, done.stderr
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in (0, 1, 3)}
    back = results[1]["changes"][1]["joined_at_step"]
    assert [c["event"] for c in results[1]["changes"]] == ["lost", "joined", "lost"]
    steps = max(STEPS, back + 4)
    expected = gossip_absent_reference({0: (at, back), 2: (back, steps)}, steps)
    for r, result in results.items():
        assert result["workers"] == 3 and result["steps"] == steps, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # CI: the join test above; its joiner lost again as it enters
def test_a_joiner_lost_as_it_enters_is_started_again_and_joins(tmp_path: Path):
    """Worker 0, killed at step 3, is started again and admitted, and dies again before the group
    with it opens (``entry``): the members see it gone (its heartbeat and the launcher's mark),
    not waiting for its rendezvous, and go on as they were; started a second time
    (``--max-restarts 2``), it joins. Every worker ends on the reference with worker 0 absent
    from step 3 until the join that held."""
    _, results, back, steps = lost_as_it_enters(tmp_path, [1, 2, 3, 0])
    expected = absent_reference({0: (3, back)}, steps)
    for result in results.values():
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)


@pytest.mark.slow  # CI: the flat all-reduce join test above; the same redo, over other groups
def test_hierarchical_all_reduce_goes_on_without_a_nodes_leader_and_takes_it_back(tmp_path: Path):
    """--workers-per-node 2 (nodes {0, 1} and {2, 3}): worker 0, node 0's leader, killed at step
    3; the survivors redo the step over the nodes of their ids (worker 1 alone leads node 0),
    and worker 0, started again, joins node 0 at a step's end. Every worker ends on the flat
    reference: the same sums, node by node."""
    at = 3
    _, results, steps, lost, joined = rejoin(tmp_path, 0, at, {"workers_per_node": 2})
    assert lost["workers"] == [0] and lost["lost_at_step"] == at and joined["members"] == [1, 2, 3, 0]
    back = joined["joined_at_step"]
    expected = reference(0, at, back, steps)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["steps"] == steps, r
        assert result["leaders"] == [1, 2], r  # node 0 of ids 0 and 1, node 1 of ids 2 and 3
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(reference(0, at + 1, back, steps), expected)  # the survivors redid step 3 without it


@pytest.mark.slow  # CI: the flat all-reduce join test above
def test_hierarchical_all_reduce_goes_on_without_a_worker_lost_as_its_node_groups_are_made(tmp_path: Path):
    """--workers-per-node 2: worker 3 killed as the run starts, about to make the node groups. The
    others meet in the launcher's store before making them, find it dead there at once (the
    groups' rendezvous would wait the whole --timeout for it), agree on [0, 1, 2] and make the
    nodes of their ids ({0, 1} and {2}); every step is theirs alone, and nothing is left running."""
    done = launch_tagged(tmp_path, -1, 0, "start", settings={"workers_per_node": 2},
                         env=kill_in(tmp_path, "node-groups", 3))
    assert done.returncode == 0, done.stderr
    assert "rank 3 failed: killed by SIGKILL; the others go on without it" in done.stderr
    assert "lost worker(s) [3] as the run started; 3 workers go on" in done.stderr
    expected = reference(3, 0)
    for r in (0, 1, 2):
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        [change] = result["changes"]
        assert (change["workers"], change["members"], change["lost_at_step"]) == ([3], [0, 1, 2], 0), r
        assert result["steps"] == STEPS and result["leaders"] == [0, 2], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(reference(3, 1), expected)  # the reference can fail: a first step with worker 3


@pytest.mark.slow  # CI: the flat all-reduce join test above
def test_hierarchical_all_reduce_goes_on_without_a_survivor_lost_as_the_node_groups_are_made_again(tmp_path: Path):
    """--workers-per-node 2: worker 0 killed as step 3 begins; the survivors agree on [1, 2, 3],
    and worker 2 dies before it makes the node groups again over them (``build``). Workers 1 and
    3 find it dead in their meeting before the groups, agree again on [1, 3] and redo step 3
    between themselves (each the only worker of its node)."""
    at = 3
    done = launch_tagged(tmp_path, 0, at, "start", settings={"workers_per_node": 2}, env=kill_in(tmp_path, "build", 2))
    assert done.returncode == 0, done.stderr
    expected = absent_reference({0: (at, STEPS), 2: (at, STEPS)}, STEPS)
    for r in (1, 3):
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        events = [(c["workers"], c["members"], c["lost_at_step"]) for c in result["changes"]]
        assert events == [([0], [1, 2, 3], at), ([2], [1, 3], at)], (r, events)
        assert result["steps"] == STEPS and result["leaders"] == [1, 3], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(absent_reference({0: (at, STEPS), 2: (at + 1, STEPS)}, STEPS), expected)


def close_in_float32(weight: torch.Tensor, expected: torch.Tensor) -> None:
    """DiLoCo's shared parameters are float32 and their sums run in an order the members' ids
    set: an element is within a few float32 roundings of the float64 ``expected``, measured on
    the vector's largest element (a small element left by large updates keeps their rounding)."""
    atol = 1e-6 * float(expected.abs().max())
    torch.testing.assert_close(weight.reshape(-1), expected, rtol=1e-5, atol=atol)


def every_worker_on(results: dict[int, dict], steps: int, expected: torch.Tensor) -> None:
    """Every worker of a DiLoCo run ended with all of them, after ``steps`` steps, on ``expected``."""
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["steps"] == steps, r
        close_in_float32(result["weight"], expected)


#: DiLoCo as model averaging: H inner steps of SGD with momentum, then the shared parameters become
#: the live workers' average (outer SGD, learning rate 1, no momentum).
DILOCO = {"algorithm": "diloco", "sync_every": 4, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}


def diloco_reference(victim: int, at: int, back: int | None, steps: int, h: int = 4, lr: float = 0.1,
                     momentum: float = 0.9, compress: str | None = None, twice: bool = False,
                     syncs: list[int] | None = None) -> torch.Tensor:
    """The shared parameters after ``steps`` inner steps: ``victim`` is gone from step ``at`` (its
    round's progress with it) until step ``back``, a round's end, where it takes the first other
    worker's parameters and momentum. ``compress``: each worker's pseudo-gradient is what that
    compressor sends of it, with error feedback (a joiner's residual starts empty); ``twice``: the
    survivors' residuals take the pseudo-gradient of the first sync after ``at`` twice. Rounds
    end every ``h`` steps, or at the step counts ``syncs`` (``--sync-every auto``)."""
    from distrain.compress import CompressInfo, build_compressor

    dim = gradient(0, 0).numel()
    shared = torch.zeros(dim, dtype=torch.float64)
    local = {r: shared.clone() for r in range(WORKERS)}
    buf: dict[int, torch.Tensor | None] = dict.fromkeys(range(WORKERS))
    feedback = {r: build_compressor(compress, residual_device="cpu") for r in range(WORKERS)} if compress else {}

    def sent(r: int, delta: torch.Tensor, step: int, again: bool) -> torch.Tensor:
        if not compress:
            return delta
        info = CompressInfo(step=step + 1, key=0, worker=r)
        if again:
            feedback[r].compress(delta, info)
        return feedback[r].decompress(*feedback[r].compress(delta, info))

    for step in range(steps):
        live = [r for r in range(WORKERS) if not (r == victim and at <= step < (steps if back is None else back))]
        if step == back:
            leader = min(r for r in live if r != victim)
            local[victim], buf[victim] = local[leader].clone(), buf[leader].clone()
            if compress:
                feedback[victim] = build_compressor(compress, residual_device="cpu")
        for r in live:
            g = gradient(r, step)
            buf[r] = g.clone() if buf[r] is None else momentum * buf[r] + g
            local[r] = local[r] - lr * buf[r]
        if (step + 1 in syncs) if syncs is not None else (step + 1) % h == 0:
            again = twice and at <= step < at + h
            shared = shared - torch.stack([sent(r, shared - local[r], step, again) for r in live]).mean(0)
            for r in live:
                local[r] = shared.clone()
    return shared


@pytest.mark.slow  # CI: the join test below loses worker 0 mid-round first
@pytest.mark.parametrize("victim,at", [(0, 5), (2, 6)])
def test_diloco_survivors_redo_the_round_without_the_lost_worker(tmp_path: Path, victim: int, at: int):
    """Killed mid-round: the survivors find it gone at the round's sync and redo the sync among
    themselves, so the round averages the survivors' local progress only."""
    done = launch(tmp_path, victim, at, "start", settings=DILOCO)
    assert done.returncode == 0, done.stderr
    survivors = sorted(set(range(WORKERS)) - {victim})
    expected = diloco_reference(victim, at, None, STEPS)
    for r in survivors:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        [change] = result["changes"]
        assert change["workers"] == [victim] and change["members"] == survivors
        close_in_float32(result["weight"], expected)
    assert not torch.allclose(diloco_reference(victim, STEPS, None, STEPS), expected, atol=1e-3)


@pytest.mark.slow  # CI: the streaming join test below, the same redo and join with an exchange in flight
def test_diloco_restarted_worker_joins_at_a_rounds_end(tmp_path: Path):
    """Worker 0 killed mid-round (step 5): the survivors redo the round's sync among themselves; it
    starts again and joins at a round's end with the shared parameters and a member's state."""
    _, results, steps, lost, joined = rejoin(tmp_path, 0, 5, DILOCO)
    back = joined["joined_at_step"]
    assert lost["workers"] == [0] and lost["members"] == [1, 2, 3]
    assert joined["workers"] == [0] and back % DILOCO["sync_every"] == 0
    expected = diloco_reference(0, 5, back, steps)
    every_worker_on(results, steps, expected)
    assert not torch.allclose(diloco_reference(0, 5, None, steps), expected, atol=1e-3)
    assert not torch.allclose(diloco_reference(0, 8, back, steps), expected, atol=1e-3)  # its round's progress died with it


def auto_h_rejoin(tmp_path: Path, reference: Callable[..., torch.Tensor],
                  **extra: object) -> tuple[list[int], int, int, torch.Tensor]:
    """DiLoCo at ``--sync-every auto`` (H from 2 to 6; ``extra`` settings besides): worker 0
    killed as step 5 begins and started again. Checks the members' records, that the first
    round is H = 2 and the last ends the run, and that every worker made the same rounds from
    the join on and ends on ``reference`` of those rounds. Returns the rounds' ends, the join's
    step, the run's steps and the reference's parameters."""
    settings = {**DILOCO, "sync_every": "auto", "sync_every_min": 2, "sync_every_max": 6, **extra}
    _, results, steps, lost, joined = rejoin(tmp_path, 0, 5, settings)
    syncs, back = results[1]["syncs"], joined["joined_at_step"]
    assert lost["workers"] == [0] and lost["members"] == [1, 2, 3] and joined["workers"] == [0]
    assert syncs[0] == 2 and back in syncs and syncs[-1] == steps
    expected = reference(0, 5, back, steps, syncs=syncs)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["steps"] == steps, r
        assert [s for s in result["syncs"] if s >= back] == [s for s in syncs if s >= back], r  # the same rounds
        close_in_float32(result["weight"], expected)
    return syncs, back, steps, expected


@pytest.mark.slow  # CI: the join test above covers DiLoCo's redo and join; this one adds H's agreement
def test_diloco_with_auto_h_survivors_agree_on_h_and_a_restarted_worker_joins(tmp_path: Path):
    """--sync-every auto (H from 2 to 6, chosen from measured times at every round's end): worker
    0 killed mid-round (step 5); the survivors redo the round's sync among themselves and agree
    on the next H; worker 0, started again, joins at a round's end with the members' H. Every
    worker ends on the reference computed from the rounds the run made."""
    syncs, back, steps, expected = auto_h_rejoin(tmp_path, diloco_reference)
    assert not torch.allclose(diloco_reference(0, 5, None, steps, syncs=syncs), expected, atol=1e-3)
    end = min(s for s in syncs if s > 5)  # worker 0's progress in the round it was lost in died with it
    assert not torch.allclose(diloco_reference(0, end, back, steps, syncs=syncs), expected, atol=1e-3)


#: Streaming DiLoCo as model averaging: two fragments (the halves of the parameter vector), the
#: first synced when the step count is 2 modulo 4, the second at multiples of 4, each exchange
#: applied one inner step after its sync.
STREAMING = {**DILOCO, "split": True, "fragments": 2, "overlap_steps": 1}


def streaming_reference(victim: int, at: int, back: int | None, steps: int, h: int = 4, overlap: int = 1,
                        lr: float = 0.1, momentum: float = 0.9, sent_late: bool = False, compress: str | None = None,
                        twice: bool = False, syncs: list[int] | None = None) -> torch.Tensor:
    """:data:`STREAMING`'s shared parameters after ``steps`` inner steps, then its end (every
    fragment that moved since its sync syncs, every exchange is applied): each exchange averages
    the pseudo-gradients of the workers live as it began, as they were then, and is applied
    ``overlap`` steps later, when every live worker's fragment takes the shared one. ``victim``
    is gone from step ``at`` until step ``back``, where it takes the shared parameters (not yet
    those of an exchange still to be applied) and the first other worker's momentum.
    ``sent_late``: the first exchange begun after the loss sends the pseudo-gradients as they are
    when it is applied instead. ``compress``: each worker sends what that compressor makes of its
    pseudo-gradient, with error feedback per fragment (a joiner's residuals start empty);
    ``twice``: the survivors' residuals take the pseudo-gradient of the sync just after the loss
    twice. ``syncs``: one fragment, synced at those step counts (``--sync-every auto``)."""
    from distrain.compress import CompressInfo, build_compressor

    dim = gradient(0, 0).numel()
    bounds = [(0, dim // 2), (dim // 2, dim)] if syncs is None else [(0, dim)]
    feedback = {r: build_compressor(compress, residual_device="cpu") for r in range(WORKERS)} if compress else {}
    offsets = [2 % h, 0] if syncs is None else [0]
    shared = torch.zeros(dim, dtype=torch.float64)
    local = {r: shared.clone() for r in range(WORKERS)}
    buf: dict[int, torch.Tensor | None] = dict.fromkeys(range(WORKERS))
    pending: list[tuple[int, int, list[int], torch.Tensor | None]] = []  # fragment, due, senders, sum
    synced = [0] * len(bounds)

    def mean(i: int, senders: list[int], count: int = 0) -> torch.Tensor:
        lo, hi = bounds[i]
        deltas = [shared[lo:hi] - local[r][lo:hi] for r in senders]
        if compress:
            info = [CompressInfo(step=count, key=i, worker=r) for r in senders]
            if twice and count == at + 1:
                for r, delta, about in zip(senders, deltas, info, strict=True):
                    feedback[r].compress(delta, about)
            deltas = [feedback[r].decompress(*feedback[r].compress(delta, about))
                      for r, delta, about in zip(senders, deltas, info, strict=True)]
        return torch.stack(deltas).mean(0)

    def apply(i: int, senders: list[int], total: torch.Tensor | None, live: list[int]) -> None:
        lo, hi = bounds[i]
        shared[lo:hi] -= mean(i, senders) if total is None else total
        for r in live:
            local[r][lo:hi] = shared[lo:hi]

    live = list(range(WORKERS))
    for step in range(steps):
        live = [r for r in range(WORKERS) if not (r == victim and at <= step < (steps if back is None else back))]
        if step == back:
            leader = min(r for r in live if r != victim)
            local[victim], buf[victim] = shared.clone(), buf[leader].clone()
            if compress:
                feedback[victim] = build_compressor(compress, residual_device="cpu")
        for r in live:
            g = gradient(r, step)
            buf[r] = g.clone() if buf[r] is None else momentum * buf[r] + g
            local[r] = local[r] - lr * buf[r]
        count = step + 1
        for i, offset in enumerate(offsets):
            if (count in syncs) if syncs is not None else count % h == offset:
                late = sent_late and count > at
                sent_late = sent_late and not late
                pending.append((i, count + overlap, list(live), None if late else mean(i, live, count)))
                synced[i] = count
        while pending and pending[0][1] <= count:
            i, _, senders, total = pending.pop(0)
            apply(i, senders, total, live)
    for i in range(len(bounds)):
        if synced[i] < steps:
            pending.append((i, steps, list(live), mean(i, live, steps)))
    for i, _, senders, total in pending:
        apply(i, senders, total, live)
    return shared


def test_streaming_diloco_redoes_an_overlapped_exchange_and_a_restarted_worker_joins(tmp_path: Path):
    """Streaming DiLoCo (two fragments, one step of overlap): worker 0 killed as step 5 begins;
    the survivors find it gone at the exchange begun after step 5, one step later, and exchange
    again among themselves the pseudo-gradients they sent then (their parameters moved since).
    Started again, it joins at a round's end while the second fragment's exchange is in flight,
    with the shared parameters, that exchange's sum and a member's momentum."""
    _, results, steps, lost, joined = rejoin(tmp_path, 0, 5, STREAMING)
    back = joined["joined_at_step"]
    assert lost["workers"] == [0] and lost["members"] == [1, 2, 3]
    assert joined["workers"] == [0] and back % DILOCO["sync_every"] == 0
    expected = streaming_reference(0, 5, back, steps)
    every_worker_on(results, steps, expected)
    assert not torch.allclose(streaming_reference(0, 5, back, steps, sent_late=True), expected, atol=1e-3)
    assert not torch.allclose(streaming_reference(0, 5, None, steps), expected, atol=1e-3)


@pytest.mark.slow  # CI: the streaming join test above covers the redo of an exchange in flight and the join
def test_diloco_with_auto_h_and_an_overlap_redoes_the_exchange_agrees_on_h_and_takes_a_joiner(tmp_path: Path):
    """--sync-every auto (H from 2 to 6) with one step of overlap: the next H is agreed once an
    exchange is applied, a step after its sync. Worker 0 killed mid-round (step 5): the survivors
    find it gone at the exchange's wait (or the agreement), exchange again among themselves the
    pseudo-gradients they sent, and agree on H; started again, it joins at a round's end with
    the exchange in flight and takes part in the agreement after its apply. Every worker ends on
    the reference computed from the rounds the run made."""
    syncs, back, steps, expected = auto_h_rejoin(tmp_path, streaming_reference, overlap_steps=1)
    assert not torch.allclose(streaming_reference(0, 5, None, steps, syncs=syncs), expected, atol=1e-3)
    assert not torch.allclose(streaming_reference(0, 5, back, steps, syncs=syncs, sent_late=True), expected, atol=1e-3)


@pytest.mark.slow  # CI: the streaming join test above
@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
def test_compressed_diloco_survivors_redo_the_sync_and_a_restarted_worker_joins(tmp_path: Path, streaming: bool):
    """Top-k pseudo-gradients with error feedback (per fragment when streamed): worker 0 killed
    as step 5 begins; the survivors find it gone at the (first fragment's) sync after step 5 (a
    compressed exchange completes at its sync) and sync again from their residuals as that sync
    began; started again, worker 0 joins at a round's end with empty residuals of its own."""
    settings, reference = ({**STREAMING, **TOPK}, streaming_reference) if streaming else ({**DILOCO, **TOPK}, diloco_reference)
    _, results, steps, lost, joined = rejoin(tmp_path, 0, 5, settings)
    back = joined["joined_at_step"]
    assert lost["workers"] == [0] and joined["workers"] == [0] and back % DILOCO["sync_every"] == 0
    expected = reference(0, 5, back, steps, compress=TOPK["compress"])
    every_worker_on(results, steps, expected)
    twice = reference(0, 5, back, steps, compress=TOPK["compress"], twice=True)
    assert not torch.allclose(twice, expected, atol=1e-3)  # residuals that kept the interrupted sync's
    assert not torch.allclose(reference(0, 5, back, steps), expected, atol=1e-3)  # the compression is in it


@pytest.mark.slow  # CI: the streaming join test above
def test_streaming_diloco_survivors_redo_the_last_exchange_as_the_run_ends(tmp_path: Path):
    """Worker 2 killed as step 7 begins: the second fragment's exchange begun after step 7 is due
    one step after the run's last, so the survivors find the loss as they end (their last syncs
    flushed in ``finish()``), exchange again what they sent, and end on the same model."""
    done = launch(tmp_path, 2, 7, "start", settings=STREAMING)
    assert done.returncode == 0, done.stderr
    expected = streaming_reference(2, 7, None, STEPS)
    for r in (0, 1, 3):
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        [change] = result["changes"]
        assert change["workers"] == [2] and change["members"] == [0, 1, 3]
        close_in_float32(result["weight"], expected)
    assert not torch.allclose(streaming_reference(2, STEPS, None, STEPS), expected, atol=1e-3)


#: D-PSGD on the complete graph with uniform weights, adapt then combine: every step averages the
#: live workers' models after their local steps (momentum stays local), so every worker stands at
#: the same step when one is lost and the result does not depend on timing.
GOSSIP = {"algorithm": "dpsgd", "topology": "complete", "mixing": "uniform", "gossip_order": "atc"}


def gossip_reference(victim: int, at: int, back: int | None, steps: int, lr: float = 0.1,
                     momentum: float = 0.9) -> torch.Tensor:
    """The workers' common model after ``steps`` steps: each live worker steps on its own momentum
    buffer, then the live workers' models are averaged; ``victim`` is gone from step ``at`` until
    step ``back``, where it takes the first other worker's model and momentum buffer."""
    return gossip_absent_reference({victim: (at, steps if back is None else back)}, steps, lr, momentum)


def gossip_absent_reference(absent: dict[int, tuple[int, int]], steps: int, lr: float = 0.1,
                            momentum: float = 0.9) -> torch.Tensor:
    """:func:`gossip_reference` with worker ``w`` absent from step ``absent[w][0]`` until step
    ``absent[w][1]``, where it takes the first other live worker's momentum buffer."""
    x = torch.zeros(gradient(0, 0).numel(), dtype=torch.float64)
    buf: dict[int, torch.Tensor] = {r: torch.zeros_like(x) for r in range(WORKERS)}
    for step in range(steps):
        live = [r for r in range(WORKERS) if not (r in absent and absent[r][0] <= step < absent[r][1])]
        for r, (_, back) in absent.items():
            if step == back:
                buf[r] = buf[min(q for q in live if q != r)].clone()
        for r in live:
            g = gradient(r, step)
            buf[r] = g.clone() if step == 0 else momentum * buf[r] + g
        x = torch.stack([x - lr * buf[r] for r in live]).mean(0)
    return x


@pytest.mark.slow  # CI: the join test below loses worker 0 first
@pytest.mark.parametrize("algorithm", ["dpsgd", "d2"])
def test_gossip_survivors_average_their_models_and_go_on(tmp_path: Path, algorithm: str):
    """Worker 0 killed as step 3 begins: the survivors keep their step's local update, average their
    models over themselves and go on gossiping among three. (D2 on the complete graph with uniform
    weights takes the same steps: its correction starts again from zero over the new members.)"""
    victim, at = 0, 3
    settings = {**GOSSIP, "algorithm": algorithm}
    if algorithm == "d2":  # (D2 always exchanges after its update: --gossip-order is refused)
        del settings["gossip_order"]
    done = launch(tmp_path, victim, at, "start", settings=settings)
    assert done.returncode == 0, done.stderr
    survivors = sorted(set(range(WORKERS)) - {victim})
    expected = gossip_reference(victim, at, None, STEPS)
    for r in survivors:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        [change] = result["changes"]
        assert change["workers"] == [victim] and change["members"] == survivors and change["lost_at_step"] == at + 1
        assert result["steps"] == STEPS and result["workers"] == WORKERS - 1, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(gossip_reference(victim, STEPS, None, STEPS), expected)


@pytest.mark.slow  # CI: the same through distrain train (tests/reliability/test_lost_peer.py)
@pytest.mark.parametrize("algorithm", ["adpsgd", "prague"])
def test_asynchronous_gossip_goes_on_without_a_worker_lost_as_its_gossip_groups_are_made(tmp_path: Path, algorithm: str):
    """Through wrap(): worker 0 (Prague's first group generator) killed as the run starts, about
    to make the gossip groups; the others agree in the launcher's store on who came, open their
    links without it, take every step and end on the mean of their own models (the consensus
    over the survivors: with the lost worker's model in it, it would differ where their models
    do); nothing is left running."""
    done = launch_tagged(tmp_path, -1, 0, "start", settings={"algorithm": algorithm},
                         env=kill_in(tmp_path, "gossip-groups", 0))
    assert done.returncode == 0, done.stderr
    assert "worker(s) [0] lost as the run started" in done.stderr
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in (1, 2, 3)}
    mean = sum(result["own"] for result in results.values()) / 3
    for r, result in results.items():
        [change] = result["changes"]
        assert (change["workers"], change["members"]) == ([0], [1, 2, 3]) and change["lost_at_step"] <= 1, r
        assert result["steps"] == STEPS and result["workers"] == WORKERS - 1, r
        torch.testing.assert_close(result["weight"], mean, rtol=0, atol=1e-12)


def test_gossip_restarted_worker_joins_with_a_members_model(tmp_path: Path):
    """Worker 0 killed as step 3 begins: the survivors average their models over themselves; it
    starts again and joins with a member's model and momentum."""
    _, results, steps, lost, joined = rejoin(tmp_path, 0, 3, GOSSIP)
    back = joined["joined_at_step"]
    assert lost["workers"] == [0] and lost["members"] == [1, 2, 3]
    assert joined["workers"] == [0] and joined["members"] == [1, 2, 3, 0] and back > 3
    expected = gossip_reference(0, 3, back, steps)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["steps"] == steps, r
        # float64, summed in another order than the reference: relative as well, for the long runs of a
        # loaded host (hundreds of steps before the joiner is back; weights of a few units, 1e-13 apart)
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(gossip_reference(0, 3, None, steps), expected)


def ring_reference(victim: int, positions: dict[int, int], steps: int, lr: float = 0.1,
                   momentum: float = 0.9) -> torch.Tensor:
    """D-PSGD's consensus after ``steps`` steps on the default ring of 4 (combine then adapt, lazy
    Metropolis weights: 2/3 for itself, 1/6 per neighbour; local momentum), ``victim`` lost: each
    survivor ``r`` stood at ``positions[r]`` steps with its last step's local update in, the
    survivors averaged their models and went on from the furthest count on a ring of 3 (the same
    weights), skipping the steps a survivor behind did not take."""
    dim = gradient(0, 0).numel()
    x = [torch.zeros(dim, dtype=torch.float64) for _ in range(WORKERS)]
    buf: list[torch.Tensor | None] = [None] * WORKERS
    at_loss: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a survivor's model and momentum buffer
    for t in range(max(positions.values())):
        grads = [gradient(r, t) for r in range(WORKERS)]
        buf = [g.clone() if b is None else momentum * b + g for b, g in zip(buf, grads, strict=True)]
        for r, c in positions.items():  # a survivor that stopped in this step: its local update only
            if c == t + 1:
                at_loss[r] = (x[r] - lr * buf[r], buf[r])
        x = [2 / 3 * x[r] + (x[(r - 1) % WORKERS] + x[(r + 1) % WORKERS]) / 6 - lr * buf[r] for r in range(WORKERS)]
    survivors = sorted(positions)
    common = torch.stack([at_loss[r][0] for r in survivors]).mean(0)
    xs = {r: common.clone() for r in survivors}
    bufs = {r: at_loss[r][1] for r in survivors}
    for t in range(max(positions.values()), steps):
        for r in survivors:
            bufs[r] = momentum * bufs[r] + gradient(r, t)
        total = sum(xs.values())
        xs = {r: 2 / 3 * xs[r] + (total - xs[r]) / 6 - lr * bufs[r] for r in survivors}
    return torch.stack(list(xs.values())).mean(0)


@pytest.mark.slow  # the complete graph's case runs in CI
def test_gossip_on_a_ring_survivors_a_step_apart_realign(tmp_path: Path):
    """On the ring, workers away from the lost one may be a step ahead when the loss shows: the
    survivors' recorded positions say where each stood; the result follows from them."""
    victim, at = 2, 3
    done = launch(tmp_path, victim, at, "start", settings={"algorithm": "dpsgd"})
    assert done.returncode == 0, done.stderr
    survivors = sorted(set(range(WORKERS)) - {victim})
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in survivors}
    positions = {r: result["changes"][0]["lost_at_step"] for r, result in results.items()}
    assert all(at <= p <= at + 2 for p in positions.values()), positions
    expected = ring_reference(victim, positions, STEPS)
    for r, result in results.items():
        assert result["steps"] == STEPS and result["changes"][0]["members"] == survivors, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(ring_reference(victim, {r: p + 1 for r, p in positions.items()}, STEPS), expected)


@pytest.mark.slow  # CI: a loss in the run's last collectives through distrain train (test_lost_peer.py)
def test_gossip_survivors_of_a_loss_as_finish_makes_the_final_model_return_their_consensus(tmp_path: Path):
    """D-PSGD on the ring: worker 1 dies as ``finish()`` begins its final consensus, after the
    members' last barrier. The others agree on the loss there and return the consensus of their
    own models (the mean of the three, which differ on the ring), not a failure."""
    victim = 1
    done = launch_tagged(tmp_path, victim, -1, "start", settings={"algorithm": "dpsgd"},
                         env=kill_in(tmp_path, "final-model", victim))
    assert done.returncode == 0, done.stderr
    assert f"rank {victim} failed: killed by SIGKILL; the others go on without it" in done.stderr
    survivors = [0, 2, 3]
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in survivors}
    own = torch.stack([results[r]["history"][-1] for r in survivors])
    assert not torch.allclose(own[0], own[1])  # (the mean below is not any one of them)
    for r, result in results.items():
        [change] = result["changes"]
        assert change["workers"] == [victim] and change["members"] == survivors, r
        assert result["steps"] == STEPS, r
        torch.testing.assert_close(result["weight"].reshape(-1), own.mean(0), rtol=0, atol=1e-12)


def ps_reference(victim: int, at: int, steps: int = STEPS, lr: float = 0.1, momentum: float = 0.9) -> torch.Tensor:
    """The parameters the servers end with: SGD with momentum on the sum of the pushes over the
    number of workers (``victim``'s from step ``at`` on missing)."""
    w = torch.zeros(gradient(0, 0).numel(), dtype=torch.float64)
    buf = None
    for step in range(steps):
        g = torch.stack([gradient(r, step) for r in range(WORKERS) if not (r == victim and step >= at)]).sum(0) / WORKERS
        buf = g.clone() if buf is None else momentum * buf + g
        w = w - lr * buf
    return w


@pytest.mark.slow  # CI: the join test below loses worker 0 first and checks the survivors' steps the same way
def test_parameter_servers_serve_the_workers_left(tmp_path: Path):
    """Two servers, worker 0 killed as step 3 begins: each server finds its push missing, declares
    it dead and serves the other three; the run ends over the survivors and the servers."""
    victim, at = 0, 3
    done = launch(tmp_path, victim, at, "start", "--servers", "2", settings={"algorithm": "ps"})
    assert done.returncode == 0, done.stderr
    assert f"lost worker {victim} at step {at + 1}" in done.stderr
    expected = check_servers_served_the_others(tmp_path, victim, at)
    assert not torch.allclose(ps_reference(victim, STEPS), expected, atol=1e-4)


def check_servers_served_the_others(out: Path, victim: int, at: int) -> torch.Tensor:
    """Every survivor of ``victim``, lost as step ``at`` began under the servers, took every step,
    recorded the loss (the workers learn it from the store; a loop then splits the data again over
    them) and ends on the servers' reference parameters (returned); the victim wrote nothing."""
    expected = ps_reference(victim, at)
    survivors = sorted(set(range(WORKERS)) - {victim})
    for r in survivors:
        result = torch.load(out / f"worker{r}.pt", weights_only=True)
        assert result["steps"] == STEPS, r
        [change] = result["changes"]
        assert (change["event"], change["workers"], change["members"]) == ("lost", [victim], survivors), change
        assert result["workers"] == WORKERS - 1 and result["ids"] == survivors, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-7)
    assert not (out / f"worker{victim}.pt").exists()
    return expected


@pytest.mark.slow  # about 25 s (six processes start); CI: distrain train's case (test_hung_worker.py)
def test_parameter_servers_have_a_hung_worker_stopped_and_serve_the_others(tmp_path: Path):
    """Two servers, worker 2 stopped (SIGSTOP) as step 3 begins: alive, its connections open,
    silent. Each server, waiting for its push, finds its heartbeat stopped and asks the launcher
    to stop it; killed, its connection resets and the servers serve the other three from that
    step (before, they waited out the 60 s --timeout, whose expiry closed every connection of the
    group: the run stopped). The survivors end on the reference of the same gradients."""
    victim, at = 2, 3
    began = time.monotonic()
    done = launch_tagged(tmp_path, victim, at, "hang", "--servers", "2", settings={"algorithm": "ps"})
    took = time.monotonic() - began
    assert done.returncode == 0, done.stderr
    assert f"rank {victim} failed: fell silent and was stopped (server " in done.stderr, done.stderr
    assert took < 50, took  # (the --timeout is 60 s)
    check_servers_served_the_others(tmp_path, victim, at)


@pytest.mark.slow  # CI: the synchronous servers' join test below loses worker 0 first
def test_asynchronous_parameter_servers_serve_the_workers_left(tmp_path: Path):
    """``--ps-mode async`` with ``--max-staleness 0``, two servers, worker 0 killed as step 3
    begins: each server's receive from it fails at once (a receive per worker, not from any), the
    others' pushes of step 3, held back by it, are answered, and from then on a round of the
    momentum is the three survivors' pushes: the sync run's result, summed over --workers."""
    victim, at = 0, 3
    settings = {"algorithm": "ps", "ps_mode": "async", "max_staleness": 0}
    done = launch(tmp_path, victim, at, "start", "--servers", "2", settings=settings)
    assert done.returncode == 0, done.stderr
    assert f"lost worker {victim} after its push {at}" in done.stderr
    expected = ps_reference(victim, at)
    survivors = sorted(set(range(WORKERS)) - {victim})
    for r in survivors:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        [change] = result["changes"]
        assert (change["event"], change["workers"], change["members"]) == ("lost", [victim], survivors), change
        assert result["steps"] == STEPS and result["ids"] == survivors, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ps_reference(victim, at + 1), expected, atol=1e-3)  # its push of step 3 never came


def hierarchical_ps_run(tmp_path: Path, victim: int, at: int, where: str, per_node: int,
                        env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    """Two servers, ``--workers-per-node per_node``, worker ``victim`` lost (killed at step ``at``
    as ``where`` says, or as ``env`` injects it): the run's process and the survivors' results,
    once nothing of the run is left running."""
    settings = {"algorithm": "ps", "workers_per_node": per_node}
    done = launch_tagged(tmp_path, victim if env is None else -1, at, where, "--servers", "2", settings=settings,
                         env=env)
    assert done.returncode == 0, done.stderr
    survivors = sorted(set(range(WORKERS)) - {victim})
    assert not (tmp_path / f"worker{victim}.pt").exists()
    return done, {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in survivors}


def check_hierarchical_ps(results: dict[int, dict], victim: int, at: int) -> None:
    """Every survivor took every step, recorded the loss and ends on the servers' parameters
    of the survivors' pushes from step ``at`` on (:func:`ps_reference`): no step lost or
    applied twice."""
    expected = ps_reference(victim, at)
    survivors = sorted(results)
    for r, result in results.items():
        [change] = result["changes"]
        assert (change["event"], change["workers"], change["members"]) == ("lost", [victim], survivors), change
        assert result["steps"] == STEPS and result["ids"] == survivors, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(ps_reference(victim, at + 1), expected, atol=1e-4)  # the reference can fail


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
@pytest.mark.parametrize("leader_lost", [False, True], ids=["server", "server-then-leader"])
def test_hierarchical_parameter_servers_take_over_a_lost_server(tmp_path: Path, leader_lost: bool):
    """``--workers-per-node 2`` (nodes {0, 1} and {2, 3}), two servers ([0, 5) and [5, 10)):
    server 1 killed as step 3 begins. The nodes' leaders (workers 0 and 2) find their pushes
    failing, agree on the takeover among themselves and server 0 takes [5, 10) over from a
    leader's copy, redoes step 3 on it (its momentum starts again) and serves it from then on.
    Then (``server-then-leader``) worker 0 is killed as step 5 begins: worker 1 leads node 0,
    takes the takeover it did not push from the store and pushes to server 0 alone."""
    at = 3
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}"}
    victim = 0 if leader_lost else -1
    done = launch_tagged(tmp_path, victim, 5, "start", "--servers", "2",
                         settings={"algorithm": "ps", "workers_per_node": 2}, env=env)
    assert done.returncode == 0, done.stderr
    assert f"took over parameters [(5, 10)] of lost server 1 at step {at + 1}" in done.stderr
    expected = ps_takeover_reference((5, 10), at, without=(0, 5) if leader_lost else None)
    survivors = [1, 2, 3] if leader_lost else list(range(WORKERS))
    for r in survivors:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["steps"] == STEPS, r
        assert [c["workers"] for c in result["changes"]] == ([[0]] if leader_lost else []), r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-7)
    if leader_lost:
        assert "worker 1: leads its node now; server 1 was lost, servers [0] hold its parameters" in done.stderr
        assert not torch.allclose(ps_takeover_reference((5, 10), at), expected, atol=1e-4)
    assert not torch.allclose(ps_reference(victim, 5), expected, atol=1e-4)  # the reset shows


@pytest.mark.slow  # CI: the flat servers' join test below loses worker 0 first
def test_hierarchical_parameter_servers_go_on_when_a_nodes_leader_dies_after_its_pull(tmp_path: Path):
    """``--workers-per-node 2`` (nodes {0, 1} and {2, 3}), two servers: worker 0, node 0's leader,
    dies once it pulled the parameters of step 1, before it hands them on to worker 1. Worker 1
    finds the node's broadcast failing, leads the node now, and pushes the step again; the
    servers, which found worker 0 gone and took worker 1 for its node's pusher, answer it with
    that step's parameters without applying it again. Every survivor ends on the parameters of
    all four workers' pushes of step 1 and the survivors' after."""
    env = kill_in(tmp_path, "node-broadcast", 0)
    done, results = hierarchical_ps_run(tmp_path, 0, 0, "start", 2, env=env)
    assert "lost worker 0 at step 2; serving the other 3 (worker 1 leads its node now)" in done.stderr
    assert "node 0 lost worker(s) [0]; 1 left, led by worker 1" in done.stderr
    check_hierarchical_ps(results, 0, 1)


@pytest.mark.slow  # CI: the flat servers' join test below
@pytest.mark.parametrize("victim,where,per_node,env", [
    (0, "start", 2, None), (1, "start", 2, None), (0, "backward", 3, None), (2, "backward", 3, None),
    (3, "start", 3, None), (1, "start", 3, "node-broadcast")],
    ids=["leader", "member", "leader-of-3", "member-of-3", "whole-node", "member-after-its-gradient"])
def test_hierarchical_parameter_servers_go_on_without_a_lost_worker(tmp_path: Path, victim: int, where: str,
                                                                     per_node: int, env: str | None):
    """A node's leader or another worker lost as step 3 begins (or between its backward and its
    step): the node's survivors meet again over their own group, sum their gradients of the
    step again and push them through their leader (the node's next worker when the leader was
    lost); a node lost whole is dropped by the servers as a worker is in flat runs. With
    ``node-broadcast`` a worker dies once it sent its gradient of the first step: the leader,
    which holds that step's answer, only hands it on."""
    at = 3
    if env is not None:
        at, env = 1, kill_in(tmp_path, env, victim)
    _, results = hierarchical_ps_run(tmp_path, victim, at, where, per_node, env=env)
    check_hierarchical_ps(results, victim, at)


@pytest.mark.slow  # CI: the flat servers' join test below
def test_a_nodes_leader_lost_as_it_ends_leaves_its_successor_to_tell_the_servers(tmp_path: Path):
    """Worker 0, node 0's leader, dies after its last step once it told server 0 (not server 1)
    that its node's training is over: worker 1 leads the node now and tells server 1 only, once
    that server took it for the node's pusher (server 0, told already, would never receive it).
    The run ends; the survivors end on the parameters of every step of all four workers, and
    record the loss after their last step."""
    done, results = hierarchical_ps_run(tmp_path, 0, 0, "start", 2, env=kill_in(tmp_path, "node-stop", 0))
    assert "server 1: lost worker 0 at step 9; serving the other 3 (worker 1 leads its node now)" in done.stderr
    expected = ps_reference(0, STEPS)
    for r, result in results.items():
        [change] = result["changes"]
        assert result["steps"] == STEPS and (change["event"], change["workers"], change["lost_at_step"]) == (
            "lost", [0], STEPS), r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # CI: the synchronous servers' join test below (the same admission)
def test_a_restarted_worker_joins_asynchronous_parameter_servers_again(tmp_path: Path):
    """``--ps-mode async --max-staleness 0``, two servers, worker 0 killed as step 3 begins and
    started again: the servers admit it as soon as it asks (no common step), each opens a link to
    it and sends it its parameters and the clock of its slowest live worker, from which it pushes
    the next round's gradient (never stale, holding nobody back), and at the end every worker gets
    the servers' final parameters. Plain SGD (momentum 0) makes the result the sum of every push
    applied, in whatever order: each worker's pushes of its steps, worker 0's of steps 0-2 and of
    its steps after it joined, over --workers; a push lost, applied twice or counted stale
    (halved) would show."""
    victim, at = 0, 3
    settings = {"algorithm": "ps", "ps_mode": "async", "max_staleness": 0, "momentum": 0}
    done, results = restarted_run(tmp_path, victim, at, settings, "--servers", "2")
    check_async_join(results, victim, at)


def check_async_join(results: dict[int, dict], victim: int, at: int) -> int:
    """Plain SGD (momentum 0) makes the servers' final parameters the sum of every push applied,
    in whatever order: each worker's pushes of its steps, ``victim``'s of its steps before
    ``at`` and after it joined, over --workers; every worker must end on them, a member of four.
    Returns the step it joined at."""
    [joined] = [c for c in results[victim]["changes"] if c["event"] == "joined"]
    back = joined["joined_at_step"]
    assert at < back < results[victim]["steps"]
    pushed = [(r, s) for r in range(WORKERS) if r != victim for s in range(results[r]["steps"])]
    pushed += [(victim, s) for s in [*range(at), *range(back, results[victim]["steps"])]]
    expected = -0.1 / WORKERS * sum(gradient(r, s) for r, s in pushed)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["ids"] == list(range(WORKERS)), r
        assert [c["event"] for c in result["changes"]] == (["joined"] if r == victim else ["lost", "joined"]), r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=1e-5, atol=1e-5)
    return back


@pytest.mark.slow  # CI: the synchronous servers' join test and distrain train's resume after a takeover (test_resume.py)
def test_a_worker_joins_asynchronous_servers_that_hold_a_lost_ones_parameters(tmp_path: Path):
    """``--ps-mode async --max-staleness 0``, two servers: worker 0 killed as step 3 begins and
    started again, server 1 killed at round 6 (the other takes over [5, 10); no restart for a
    lost asynchronous server). The worker joins the one live server, which sends it every range it
    holds, and pushes them all to it from then on; each push is applied once, whichever server
    held its range (momentum 0: the result is the sum of the pushes)."""
    victim, at, server_at = 0, 3, 6
    settings = {"algorithm": "ps", "ps_mode": "async", "max_staleness": 0, "momentum": 0}
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{server_at}"}
    done = launch(tmp_path, victim, at, "rejoin", "--servers", "2", "--max-restarts", "1", settings=settings, env=env)
    assert done.returncode == 0, done.stderr
    assert "took over parameters [(5, 10)] of lost server 1" in done.stderr
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}
    assert check_async_join(results, victim, at) > server_at


def ps_join_reference(victim: int, at: int, back: int, steps: int, lr: float = 0.1,
                      momentum: float = 0.9, fresh: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """What the two servers compute, in their float32 and on their own shards ([0, 5) and [5, 10)):
    each step the sum of the pushes (a missing one a row of zeros) over the number of workers,
    then one step of SGD with momentum; ``victim``'s pushes are missing from step ``at`` until it
    joins after step ``back``. ``fresh``: ``(shard, step)`` pairs, that shard's momentum starting
    again at that step (its server was lost and the other took it over)."""
    shards = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(5))]
    optimizers = [torch.optim.SGD([w], lr=lr, momentum=momentum) for w in shards]
    for step in range(steps):
        for shard in [s for s, at_step in fresh if at_step == step]:
            optimizers[shard] = torch.optim.SGD([shards[shard]], lr=lr, momentum=momentum)
        pushes = torch.zeros(WORKERS, gradient(0, 0).numel())  # float32, as on the wire
        for r in range(WORKERS):
            if not (r == victim and at <= step < back):
                pushes[r] = gradient(r, step)
        for s, (w, optimizer) in enumerate(zip(shards, optimizers, strict=True)):
            w.grad = pushes[:, 5 * s : 5 * s + 5].sum(0).div_(WORKERS)
            optimizer.step()
    return torch.cat([w.detach() for w in shards]).double()


def ps_rejoin(tmp_path: Path, victim: int, at: int, settings: dict) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    """Two servers, worker ``victim`` killed as step ``at`` begins and started again (--max-restarts
    1): the run's process and every worker's result, once nothing of it is left running."""
    return restarted_run(tmp_path, victim, at, settings, "--servers", "2")


def test_a_restarted_worker_joins_the_parameter_servers_again(tmp_path: Path):
    """Two servers, worker 0 (which started them) killed as step 3 begins and started again
    (--max-restarts 1): the servers serve the other three, then at a step's end agreed in the
    launcher's store they open a link to it, send it their parameters of that step and wait for
    its push again from the next one. No step is lost or applied twice: every worker ends with
    the servers' parameters, bit for bit; nothing is left running."""
    victim, at = 0, 3
    _, results = ps_rejoin(tmp_path, victim, at, {"algorithm": "ps"})
    lost, joined = results[1]["changes"]
    assert (lost["event"], lost["workers"], lost["members"]) == ("lost", [0], [1, 2, 3])
    assert (joined["event"], joined["workers"], joined["members"]) == ("joined", [0], [0, 1, 2, 3])
    back = joined["joined_at_step"]
    steps = max(STEPS, back + 4)
    assert at < back
    expected = ps_join_reference(victim, at, back, steps)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["ids"] == [0, 1, 2, 3] and result["steps"] == steps, r
        assert result["changes"][-1] == {**result["changes"][-1], "event": "joined", "joined_at_step": back}, r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=0)
    assert [c["event"] for c in results[0]["changes"]] == ["joined"]  # its own record: it joined
    # the reference can fail: without the joiner's pushes after it joined, or with them all along
    assert not torch.allclose(ps_join_reference(victim, at, steps, steps), expected, atol=1e-4)
    assert not torch.allclose(ps_join_reference(victim, at, at, steps), expected, atol=1e-4)


@pytest.mark.slow  # the join above runs in CI
def test_a_worker_lost_as_it_joins_the_parameter_servers_is_not_waited_for(tmp_path: Path):
    """Two servers; worker 0, killed at step 3 and started again, dies once admitted, before its
    link with the servers opens (``entry``): the servers see it gone (its heartbeat, stamped from
    before it asked, stops; a new life of it asks) instead of waiting in the link's rendezvous for
    the whole timeout, serve the others on, and the workers read its loss; started a second time
    (``--max-restarts 2``), it joins. Every worker ends on the servers' parameters with worker 0
    absent from step 3 until the join that held."""
    done, results, back, steps = lost_as_it_enters(tmp_path, [0, 1, 2, 3], "--servers", "2",
                                                   settings={"algorithm": "ps"})
    assert done.stderr.count("was lost again before it took its parameters") == 2  # each server
    expected = ps_join_reference(0, 3, back, steps)
    for result in results.values():
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=0, atol=0)


@pytest.mark.slow  # the uncompressed join above runs in CI
def test_a_restarted_worker_joins_compressed_parameter_servers_again(tmp_path: Path):
    """The same with top-k pushes, error feedback and momentum correction: worker 2 joins again (its
    residuals and momentum start from zero: a fresh process), and every worker ends with the
    servers' parameters, bit for bit."""
    _, results = ps_rejoin(tmp_path, 2, 3, {"algorithm": "ps", "compress": "topk:0.5", "momentum_correction": "on"})
    lost, joined = results[0]["changes"]
    assert (lost["workers"], lost["members"], joined["workers"], joined["members"]) == ([2], [0, 1, 3], [2], [0, 1, 2, 3])
    steps = max(STEPS, joined["joined_at_step"] + 4)
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["steps"] == steps, r
        torch.testing.assert_close(result["weight"], results[0]["weight"], rtol=0, atol=0)


def ps_worker_and_server_back(tmp_path: Path, victim: int, at: int, server_at: int,
                              restarts: int) -> tuple[dict[int, dict], int]:
    """Two servers; worker ``victim`` killed as step ``at`` begins and server 1 as round
    ``server_at`` begins, with ``restarts`` restarts: every worker's result and the step after
    which the worker joined again, checked against the reference (the worker's pushes missing
    until it joined, server 1's range with its momentum started again where it was taken over)."""
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{server_at}",
           "ELASTIC_SERVER_BACK": "1" if restarts > 1 else "0"}
    done = launch(tmp_path, victim, at, "rejoin", "--servers", "2", "--max-restarts", str(restarts),
                  settings={"algorithm": "ps"}, env=env)
    assert done.returncode == 0, done.stderr
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}
    lost, joined = results[min(r for r in range(WORKERS) if r != victim)]["changes"]
    assert (lost["workers"], joined["workers"], joined["members"]) == ([victim], [victim], list(range(WORKERS)))
    back = joined["joined_at_step"]
    steps = max(STEPS, back + 4, *(r["server_back"][0] + 4 for r in results.values() if r["server_back"]))
    expected = ps_join_reference(victim, at, back, steps, fresh=((1, server_at),))
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["ids"] == list(range(WORKERS)), r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(ps_join_reference(victim, at, back, steps), expected, atol=1e-4)  # the reset shows
    return results, back


@pytest.mark.slow
def test_a_worker_joins_servers_that_hold_a_lost_ones_parameters(tmp_path: Path):
    """Worker 0 lost at step 3 and started again (the one restart), then server 1 at round 6 (the
    other takes over its parameters; no restart is left for it): the worker joins the one live
    server, which sends it the ranges it owns, and pushes them to it alone from then on."""
    results, back = ps_worker_and_server_back(tmp_path, 0, 3, 6, restarts=1)
    assert back > 6 and not any(r["server_back"] for r in results.values())


@pytest.mark.slow
def test_a_worker_and_a_server_started_again_both_come_back(tmp_path: Path):
    """Worker 2 and server 1 both lost at step 3 and started again (--max-restarts 2): whether
    they are admitted at the same step or one after the other, the server takes its range back
    and the worker joins, and every worker ends on the reference."""
    results, _ = ps_worker_and_server_back(tmp_path, 2, 3, 3, restarts=2)
    assert all(r["server_back"] for r in results.values())


def ps_takeover_reference(lost: tuple[int, int], at: int, steps: int = STEPS, lr: float = 0.1,
                          momentum: float = 0.9, servers: int | None = None,
                          without: tuple[int, int] | None = None) -> torch.Tensor:
    """SGD with momentum on every worker's gradient, the momentum of the parameters in ``lost``
    (a lost server's range) starting again from zero at step ``at`` (the step redone by the
    servers that took them over). ``servers``: each worker pushes the top-k of each of that many
    shards with error feedback (:data:`TOPK`, keyed by the shard), and the servers sum what the
    pushes decode to. ``without``: (worker, step) that worker's gradients missing from that step
    on (the sum still over every worker, as the servers take it)."""
    from distrain.algorithms.parameter_server import shard_bounds
    from distrain.compress import CompressInfo, build_compressor

    feedback = {r: build_compressor(TOPK["compress"]) for r in range(WORKERS)}
    w = torch.zeros(gradient(0, 0).numel(), dtype=torch.float64)
    buf = None
    for step in range(steps):
        pushed = [gradient(r, step) * (without is None or r != without[0] or step < without[1]) for r in range(WORKERS)]
        if servers is not None:
            for r, g in enumerate(pushed):
                pushed[r] = torch.cat([feedback[r].decompress(*feedback[r].compress(
                    g[lo:hi], CompressInfo(step=step, key=k, ratio=0.2, worker=r)))
                    for k, (lo, hi) in enumerate(shard_bounds(g.numel(), servers))])
        g = torch.stack(pushed).mean(0)
        buf = g.clone() if buf is None else momentum * buf + g
        if step == at:
            buf[lost[0] : lost[1]] = g[lost[0] : lost[1]]
        w = w - lr * buf
    return w


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_parameter_servers_take_over_a_lost_server(tmp_path: Path):
    """Three servers over 10 parameters ([0, 4), [4, 7), [7, 10)); server 1 is killed as step 3
    begins: every worker finds its push failing, and the two others take over [4, 6) and [6, 7)
    from a worker's copy, redo step 3 on them with every worker's gradient (their momentum starts
    again) and serve them from then on: no step lost or applied twice."""
    at, workers = 3, list(range(WORKERS))
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}"}
    done = launch(tmp_path, -1, at, "start", "--servers", "3", settings={"algorithm": "ps"}, env=env)
    assert done.returncode == 0, done.stderr
    assert "took over parameters [(4, 6)] of lost server 1 at step 4" in done.stderr
    assert "took over parameters [(6, 7)] of lost server 1 at step 4" in done.stderr
    expected = ps_takeover_reference((4, 7), at)
    for r in workers:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["steps"] == STEPS and result["workers"] == WORKERS and result["changes"] == [], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(reference(-1, STEPS), expected, atol=1e-4)  # the reset shows


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_parameter_servers_take_over_a_lost_server_under_compressed_pushes(tmp_path: Path):
    """The same with top-k pushes and error feedback: each worker compresses each of the three
    shards (its residual keyed by the shard) and, after the takeover, sends server 0 the messages
    of shards 0 and 1 and server 2 those of shards 1 and 2, each keeping its pieces; the step
    redone on the pieces carries what the lost server would have decoded. The residuals go on
    as if no server had been lost."""
    at = 3
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}"}
    done = launch(tmp_path, -1, at, "start", "--servers", "3", settings={"algorithm": "ps", **TOPK}, env=env)
    assert done.returncode == 0, done.stderr
    assert "took over parameters [(4, 6)] of lost server 1 at step 4" in done.stderr
    assert "took over parameters [(6, 7)] of lost server 1 at step 4" in done.stderr
    expected = ps_takeover_reference((4, 7), at, servers=3)
    for r in range(WORKERS):
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["steps"] == STEPS and result["workers"] == WORKERS and result["changes"] == [], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(ps_takeover_reference((4, 7), at), expected, atol=1e-4)  # the compression is in it
    assert not torch.allclose(ps_takeover_reference((4, 7), STEPS, servers=3), expected, atol=1e-4)  # the reset shows


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's loss (test_resume.py)
def test_a_users_state_saved_while_a_server_is_taken_over_resumes_with_every_server(tmp_path: Path):
    """wrap(), two servers; server 1 killed as step 3 begins, server 0 takes [5, 10) over with its
    momentum afresh. At step 5 each worker saves ``opt.state_dict()``: the servers' state, each
    shard's put together from what server 0 holds. A run started from those files with both
    servers ends where the first one ends: server 1 serves [5, 10) again with that momentum."""
    at, save = 3, 5
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}", "ELASTIC_SAVE_AT": str(save)}
    done = launch(first, -1, at, "start", "--servers", "2", settings={"algorithm": "ps"}, env=env)
    assert done.returncode == 0, done.stderr
    done = launch(second, -1, -1, "start", "--servers", "2", settings={"algorithm": "ps"},
                  env={**os.environ, "ELASTIC_RESUME": str(first)})
    assert done.returncode == 0, done.stderr
    expected = ps_takeover_reference((5, 10), at)
    for r in range(WORKERS):
        before, after = (torch.load(d / f"worker{r}.pt", weights_only=True) for d in (first, second))
        assert before["steps"] == after["steps"] == STEPS and len(after["history"]) == STEPS - save, r
        for result in (before, after):
            torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-7)
    # the reference can fail: had the momentum of [5, 10) started again at the resume
    assert not torch.allclose(ps_takeover_reference((5, 10), save), expected, atol=1e-4)


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_parameter_servers_take_over_a_server_lost_while_it_answered_some_workers(tmp_path: Path):
    """Two servers ([0, 5) and [5, 10)); server 1 answers step 3 to workers 0 and 1 only, then dies
    (once they pushed step 4): workers 2 and 3 find it lost at step 3, 0 and 1 at step 4. The
    two who are behind take its answer of step 3 from one who got it (over the store), push step
    4, and then all four take it over together at step 4: server 0 redoes step 4 on [5, 10) with
    a fresh momentum. No step lost or applied twice, every worker on the same parameters."""
    at = 3
    env = {**os.environ, "DISTRAIN_INJECT_KILL_ANSWERING": f"{WORKERS + 1}:{at}:2"}
    done = launch(tmp_path, -1, at, "start", "--servers", "2", settings={"algorithm": "ps"}, env=env)
    assert done.returncode == 0, done.stderr
    for r in (2, 3):
        assert f"worker {r}: server 1 was lost as it answered step {at}; its answer taken from a worker" in done.stderr
    assert "took over parameters [(5, 10)] of lost server 1 at step 4" in done.stderr
    expected = ps_takeover_reference((5, 10), at)  # step 3's answer stands; step 4 (index 3) redone afresh
    for r in range(WORKERS):
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["steps"] == STEPS and result["workers"] == WORKERS and result["changes"] == [], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-7)
    # the reference can fail: had the workers behind taken it over at step 3 from their own copy
    assert not torch.allclose(ps_takeover_reference((5, 10), at - 1), expected, atol=1e-4)


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_asynchronous_servers_take_over_a_lost_server(tmp_path: Path):
    """``--ps-mode async --max-staleness 0``, three servers over 10 parameters; server 1 is killed
    once it applied the first push of round 3: every worker finds its pull failing, the first to
    report it settles the takeover in the store, and each sends the two others its copy of their
    pieces ([4, 6) and [6, 7)) and its push of round 3 again. The servers start the pieces from
    the first copy, their momentum afresh, and serve them from then on, holding each answer on
    the pieces back until every worker's push is redone (``--max-staleness 0``): after every step
    each worker holds the synchronous run's parameters, with the pieces' momentum started again
    at round 3, and ends on the servers' final ones."""
    at, workers = 3, list(range(WORKERS))
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}"}
    settings = {"algorithm": "ps", "ps_mode": "async", "max_staleness": 0}
    done = launch(tmp_path, -1, at, "start", "--servers", "3", settings=settings, env=env)
    assert done.returncode == 0, done.stderr
    assert "took over parameters [(4, 6)] of lost server 1 at worker" in done.stderr
    assert "took over parameters [(6, 7)] of lost server 1 at worker" in done.stderr
    assert all(f"worker {r}: lost server 1 at its push {at}" in done.stderr for r in workers), done.stderr
    expected = ps_takeover_reference((4, 7), at - 1)  # push 3 is round 3, the third: step 2
    for r in workers:
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["steps"] == STEPS and result["workers"] == WORKERS and result["changes"] == [], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-6, atol=1e-6)
        for step, held in enumerate(result["history"]):  # what it pulled after each step
            torch.testing.assert_close(held, ps_takeover_reference((4, 7), at - 1, step + 1).float().double(),
                                       rtol=1e-6, atol=1e-6, msg=lambda m, r=r, step=step: f"worker {r}, step {step}: {m}")
    assert not torch.allclose(ps_takeover_reference((4, 7), at), expected, atol=1e-4)  # the round reset shows


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_asynchronous_servers_take_over_a_lost_server_under_compressed_pushes(tmp_path: Path):
    """The asynchronous takeover above with top-k pushes and error feedback per shard: each
    worker's push redone on the pieces is what its message to the lost server decodes to, and
    every later push carries the messages of the shards each live server holds pieces of."""
    at = 3
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}"}
    settings = {"algorithm": "ps", "ps_mode": "async", "max_staleness": 0, **TOPK}
    done = launch(tmp_path, -1, at, "start", "--servers", "3", settings=settings, env=env)
    assert done.returncode == 0, done.stderr
    assert "took over parameters [(4, 6)] of lost server 1 at worker" in done.stderr
    for r in range(WORKERS):
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert result["steps"] == STEPS and result["workers"] == WORKERS and result["changes"] == [], r
        for step, held in enumerate(result["history"]):
            torch.testing.assert_close(held, ps_takeover_reference((4, 7), at - 1, step + 1, servers=3).float().double(),
                                       rtol=1e-6, atol=1e-6, msg=lambda m, r=r, step=step: f"worker {r}, step {step}: {m}")
    assert not torch.allclose(ps_takeover_reference((4, 7), at - 1), ps_takeover_reference((4, 7), at - 1, servers=3))


@pytest.mark.slow  # CI: the synchronous servers' join test and distrain train's resume after a takeover (test_resume.py)
def test_a_worker_that_ended_takes_a_lost_asynchronous_servers_parameters_at_the_end(tmp_path: Path):
    """``--ps-mode async --max-staleness 0``, two servers: worker 3 takes 4 steps and ends (its
    STOP sent, it waits for the final parameters); server 1 is killed at round 6, which only
    workers 0 to 2 reach, and they take it over. Worker 3 never pushes to a lost server: its
    final receive from server 1 fails, and server 0's final parameters, sent with the ranges it
    holds, cover them. Every worker ends on the same parameters: the sum of every push applied
    (momentum 0), worker 3's four included."""
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:6", "ELASTIC_STEPS_OF": "3:4"}
    settings = {"algorithm": "ps", "ps_mode": "async", "max_staleness": 0, "momentum": 0}
    done = launch(tmp_path, -1, 0, "start", "--servers", "2", settings=settings, env=env)
    assert done.returncode == 0, done.stderr
    assert "took over parameters [(5, 10)] of lost server 1" in done.stderr
    assert "worker 3: lost server" not in done.stderr  # it learnt of the loss only at the end
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}
    assert [results[r]["steps"] for r in range(WORKERS)] == [STEPS, STEPS, STEPS, 4]
    pushed = [(r, s) for r in range(WORKERS) for s in range(results[r]["steps"])]
    expected = -0.1 / WORKERS * sum(gradient(r, s) for r, s in pushed)
    for r, result in results.items():
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=1e-5, atol=1e-5, msg=f"worker {r}")


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_a_restarted_server_takes_its_parameters_back_under_compressed_pushes(tmp_path: Path):
    """The return below with top-k pushes and error feedback per shard: the workers' residuals
    of server 1's shard go on through its loss and return; the reference is the compressed run
    with that shard's momentum started again at step 3, and kept through the return."""
    at = 3
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}", "ELASTIC_SERVER_BACK": "1"}
    done = launch(tmp_path, -1, at, "rejoin", "--servers", "2", "--max-restarts", "1",
                  settings={"algorithm": "ps", **TOPK}, env=env)
    assert done.returncode == 0, done.stderr
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}
    [back] = {tuple(result["server_back"]) for result in results.values()}
    steps = max(STEPS, back[0] + 4)
    assert at < back[0] and f"server 0: server 1 returned after step {back[0]}" in done.stderr
    expected = ps_takeover_reference((5, 10), at, steps, servers=2)
    for r, result in results.items():
        assert result["steps"] == steps and result["workers"] == WORKERS and result["changes"] == [], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected.float().double(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ps_takeover_reference((5, 10), steps, steps, servers=2), expected, atol=1e-4)


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_a_restarted_server_takes_its_parameters_back(tmp_path: Path):
    """Two servers ([0, 5) and [5, 10)); server 1 is killed as step 3 begins and started again
    (--max-restarts 1): server 0 takes over [5, 10) and redoes step 3 on it (its momentum starts
    again), then at a step's end agreed in the store server 1 takes the range back: its
    parameters from a worker, their momentum from server 0. No step lost or applied twice, and
    the momentum goes on across the return; nothing is left running."""
    at = 3
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}", "ELASTIC_SERVER_BACK": "1"}
    done = launch(tmp_path, -1, at, "rejoin", "--servers", "2", "--max-restarts", "1", settings={"algorithm": "ps"},
                  env=env)
    assert done.returncode == 0, done.stderr
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}
    [back] = {tuple(result["server_back"]) for result in results.values()}  # every worker saw it after one step
    steps = max(STEPS, back[0] + 4)
    assert at < back[0] and f"server 0: server 1 returned after step {back[0]}" in done.stderr
    expected = ps_join_reference(-1, at, at, steps, fresh=((1, at),))  # the servers' float32, over many steps
    for r, result in results.items():
        assert result["steps"] == steps and result["workers"] == WORKERS and result["changes"] == [], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=1e-6, atol=1e-7)
    # the reference can fail: had the returned server started its momentum again, or never been lost
    assert not torch.allclose(ps_join_reference(-1, at, at, steps, fresh=((1, at), (1, back[0]))), expected, atol=1e-4)
    assert not torch.allclose(ps_join_reference(-1, at, at, steps), expected, atol=1e-4)


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_a_joiner_left_out_by_a_server_lost_as_it_comes_leaves_a_users_script_and_the_others_go_on(tmp_path: Path):
    """distrain launch: worker 0, killed as step 3 begins, starts again, and server 1 dies as the
    servers open the link with it (``link``). The joiner leaves its script left out (exit status
    3, which distrain launch counts as a loss: its one restart is spent), server 0 serves the
    others, who take server 1 over and end on the same parameters; nothing is left running."""
    env = {**os.environ, "DISTRAIN_INJECT_KILL_IN": f"link:{WORKERS + 1}"}
    done = launch_tagged(tmp_path, 0, 3, "rejoin", "--servers", "2", "--max-restarts", "1",
                         settings={"algorithm": "ps"}, env=env)
    assert done.returncode == 0, done.stderr
    assert "worker 0: server(s) [1] lost as this worker joined; it leaves the run, the others go on" in done.stderr
    assert "rank 0 failed" in done.stderr and "the others go on without it" in done.stderr
    assert not (tmp_path / "worker0.pt").exists()
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in (1, 2, 3)}
    for r in (2, 3):
        torch.testing.assert_close(results[r]["weight"], results[1]["weight"], rtol=0, atol=0)


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_a_server_lost_again_as_it_returns_leaves_its_parameters_with_the_others(tmp_path: Path):
    """Server 1 killed as step 3 begins, started again (--max-restarts 1) and admitted back, then
    killed again before it met anyone (``entry``): the workers and server 0 see its heartbeat stop
    instead of waiting for it in the link's rendezvous until --timeout, and server 0 keeps serving
    [5, 10) as it has since its takeover. Every worker ends on the takeover's reference."""
    at = 3
    env = {**os.environ, "DISTRAIN_INJECT_KILL": f"{WORKERS + 1}:{at}", "DISTRAIN_INJECT_KILL_IN": f"entry:{WORKERS + 1}",
           "ELASTIC_SERVER_BACK": "missed"}
    done = launch(tmp_path, -1, at, "rejoin", "--servers", "2", "--max-restarts", "1", settings={"algorithm": "ps"},
                  env=env)
    assert done.returncode == 0, done.stderr
    assert "server 0: server 1 was lost again as it returned after step" in done.stderr
    results = {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}
    [(steps, back)] = {(result["steps"], tuple(result["server_back"])) for result in results.values()}
    assert back and steps == max(STEPS, back[0] + 4)
    # the servers' float32, over the steps until it was seen lost again (hundreds on a loaded host)
    expected = ps_join_reference(-1, at, at, steps, fresh=((1, at),))
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["changes"] == [], r
        torch.testing.assert_close(result["weight"].reshape(-1), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # CI: the Prague join test below loses worker 0 the same way first
def test_asynchronous_gossip_in_a_users_script_goes_on_without_its_generator(tmp_path: Path):
    """Prague through wrap() and distrain launch, worker 0 (which forms the groups at first)
    killed as step 3 begins: worker 1 takes over the groups and the three finish their steps and
    agree on one consensus model."""
    done = launch(tmp_path, 0, 3, "start", settings={"algorithm": "prague"})
    assert done.returncode == 0, done.stderr
    assert "worker 1 forms the groups from now on" in done.stderr
    results = [torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in (1, 2, 3)]
    assert all(r["steps"] == STEPS for r in results)
    for r in results[1:]:
        torch.testing.assert_close(r["weight"], results[0]["weight"])  # the survivors' consensus
    assert not (tmp_path / "worker0.pt").exists()


@pytest.mark.slow  # `make test-all`: the all-reduce --min-workers test and the unit test of survives() are the CI's
def test_min_workers_equal_to_workers_stops_asynchronous_gossip(tmp_path: Path):
    done = launch(tmp_path, 2, 3, "start", "--min-workers", "4", settings={"algorithm": "adpsgd"})
    assert done.returncode != 0
    assert "rank 2" in done.stderr and "killed by SIGKILL" in done.stderr, done.stderr
    assert not any(tmp_path.glob("worker*.pt"))


def gossip_rejoin(tmp_path: Path, victim: int, settings: dict) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    """Worker ``victim`` killed as step 3 begins and started again (--max-restarts 1): the run's
    process and every worker's result, once nothing of it is left running."""
    return restarted_run(tmp_path, victim, 3, settings)


def restarted_run(tmp_path: Path, victim: int, at: int, settings: dict,
                  *flags: str) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    """Worker ``victim`` killed as step ``at`` begins and started again (--max-restarts 1; ``flags``
    for the launcher besides): the run's process, once it said so once and nothing of it is left
    running, and every worker's result."""
    done = launch_tagged(tmp_path, victim, at, "rejoin", *flags, "--max-restarts", "1", settings=settings)
    assert done.returncode == 0, done.stderr
    assert f"rank {victim} failed: killed by SIGKILL; started again, it joins the others with their state" in done.stderr
    assert done.stderr.count(f"worker {victim} joined the run at step") == 1
    return done, {r: torch.load(tmp_path / f"worker{r}.pt", weights_only=True) for r in range(WORKERS)}


def check_gossip_rejoin(results: dict[int, dict], victim: int, near: float | None = 0.1) -> None:
    """Every worker ends as a member of four, the members recorded the loss and the join, and the
    consensus every worker holds is the average of the four workers' own final models (the
    joiner's among them: without it, the average of three differs); the joiner's own model comes
    within ``near`` of the others' average (None: not checked)."""
    own = torch.stack([results[r]["own"].reshape(-1) for r in range(WORKERS)])
    for r, result in results.items():
        assert result["workers"] == WORKERS and result["ids"] == list(range(WORKERS)), r
        torch.testing.assert_close(result["weight"].reshape(-1), own.mean(0), rtol=0, atol=1e-12)
        if r == victim:
            assert [c["event"] for c in result["changes"]] == ["joined"]
        else:
            lost, joined = result["changes"]
            assert (lost["event"], lost["workers"]) == ("lost", [victim]), r
            assert (joined["event"], joined["workers"], joined["members"]) == ("joined", [victim], list(range(WORKERS)))
    # it trained after it joined, and averaged with the others: its model comes near theirs. How near
    # depends on how many averagings the finished workers made after its last step (timing: 0.011
    # apart once under load, 1e-6 on a quiet machine); one that never averaged after its steps of
    # lr 0.1 on unit gradients would stand about 1 apart
    joined_at = results[victim]["changes"][0]["joined_at_step"]
    assert results[victim]["steps"] == max(STEPS, joined_at + 4), (results[victim]["steps"], joined_at)
    assert results[victim]["rounds"] >= 1  # it averaged with the others after it joined
    survivors = [r for r in range(WORKERS) if r != victim]
    if near is not None:
        torch.testing.assert_close(own[victim], own[survivors].mean(0), rtol=0, atol=near)


@pytest.mark.slow  # the joins above run in CI
@pytest.mark.parametrize("algorithm", ["adpsgd", "prague"])
def test_asynchronous_gossip_goes_on_without_a_joiner_lost_as_it_enters(tmp_path: Path, algorithm: str):
    """Worker 0, killed at step 3 and started again, dies once admitted, before it opened its
    links (``entry``): its neighbours see it gone (its heartbeat, stamped from before it asked,
    stops) instead of waiting for it in the links' rendezvous, drop it, and the three end
    without it (``--max-restarts 1``: no third life; the join tests above cover a join)."""
    done = launch_tagged(tmp_path, 0, 3, "rejoin", "--max-restarts", "1", settings={"algorithm": algorithm},
                         env=kill_in(tmp_path, "entry", 0))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mark").exists()
    assert "worker 0 was admitted but died again before it came" in done.stderr
    for r in (1, 2, 3):
        result = torch.load(tmp_path / f"worker{r}.pt", weights_only=True)
        assert torch.isfinite(result["weight"]).all() and result["steps"] >= STEPS, r


@pytest.mark.slow  # stalled until --peer-timeout in about 1 run of 10 (a neighbour dropped the joiner on its
# earlier life's dead mark, fixed); then in about 1 run of 25 (a neighbour that learned the joiner had finished
# before it read the admission kept it lost, fixed in SharedModel.revive). The gossip family's join stays in CI
# through dpsgd
def test_a_restarted_worker_joins_adpsgd_again(tmp_path: Path):
    """AD-PSGD on a ring of 4, worker 2 (active: it calls 1 and 3) killed as step 3 begins and started
    again: the others admit it as soon as one of them sees it ask, its passive neighbours each open a
    link with it and hand it their model, it calls them again over those links, and all four finish
    and agree on one consensus, the average of their four models."""
    _, results = gossip_rejoin(tmp_path, 2, {"algorithm": "adpsgd"})
    check_gossip_rejoin(results, 2)


def test_a_restarted_worker_0_joins_prague_again(tmp_path: Path):
    """Prague on 4 workers, worker 0 (which forms the groups at first) killed as step 3 begins and
    started again: worker 1 takes over the groups, the others admit worker 0 as soon as one of them
    sees it ask, each opens links with it and hands it its model, the generator groups it like
    anyone else, and all four finish and agree on one consensus, the average of their four models."""
    done, results = gossip_rejoin(tmp_path, 0, {"algorithm": "prague"})
    assert "worker 1 forms the groups from now on" in done.stderr
    check_gossip_rejoin(results, 0, near=None)
    # Prague stops every worker once all are done, and groups of two end in pairs that averaged
    # apart (0.16 from the average each, once): the joiner stands no further from the survivors'
    # average than they do, give or take its last step. One that never averaged after joining
    # would stand a dozen of the survivors' steps apart, several units.
    own = torch.stack([results[r]["own"].reshape(-1) for r in range(WORKERS)])
    survivors = own[1:].mean(0)
    spread = max(float((own[r] - survivors).abs().max()) for r in range(1, WORKERS))
    assert float((own[0] - survivors).abs().max()) <= spread + 0.5
