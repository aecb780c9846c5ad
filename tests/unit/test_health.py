"""Heartbeats name the worker that stopped stamping."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from distrain.launch.common import free_port
from distrain.runtime.health import Heartbeat


def test_a_worker_that_stops_stamping_becomes_the_suspect():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    beats = [Heartbeat("127.0.0.1", port, rank=r, world_size=3, interval=0.1).start() for r in range(3)]
    try:
        assert beats[0].wait_for_suspects(patience=0.5) == []  # everyone alive: nobody suspected
        beats[2].stop()  # worker 2 "dies"
        assert beats[0].wait_for_suspects(patience=5) == [2]
        assert beats[1].wait_for_suspects(patience=5) == [2]
    finally:
        for b in beats:
            b.stop()
    del master
    # With the store's host gone, rank 0 (its host) is the suspect.
    assert Heartbeat("127.0.0.1", port, rank=1, world_size=3, interval=0.1).suspects() == [0]


def test_finishers_wait_for_every_process_to_finish_or_be_declared_dead():
    """Four processes over one store: 2 is declared dead, the others finish in turn; every
    finisher gets the same list, only once the last live one has finished."""
    import threading

    from distrain.runtime.health import declare_dead, finishers

    store = dist.HashStore()
    results: dict[int, list[int]] = {}
    threads = {r: threading.Thread(target=lambda r=r: results.__setitem__(r, finishers(store, r, 4, timeout=30)))
               for r in (0, 1, 3)}
    for r in (0, 1):
        threads[r].start()
    declare_dead(store, 2)
    threads[0].join(0.3)
    assert threads[0].is_alive() and not results  # 3 has neither finished nor died yet
    threads[3].start()
    for t in threads.values():
        t.join(30)
    assert results == {0: [0, 1, 3], 1: [0, 1, 3], 3: [0, 1, 3]}


def test_a_store_group_gathers_and_sums_over_its_members_only():
    import threading

    import torch

    from distrain.comm.store_group import StoreGroup

    store, members = dist.HashStore(), [1, 2, 4]
    out: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def member(me: int) -> None:
        group = StoreGroup(store, members, me, timeout=30)
        rows = group.control_all_gather(torch.tensor([me, 10.0 * me], dtype=torch.float64))
        total = group.control_all_reduce(torch.full((2, 2), float(me)))
        group.control_barrier()
        out[me] = (rows, total)

    threads = [threading.Thread(target=member, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for me in members:
        rows, total = out[me]
        assert [r.tolist() for r in rows] == [[1.0, 10.0], [2.0, 20.0], [4.0, 40.0]]
        assert torch.equal(total, torch.full((2, 2), 7.0))
    assert StoreGroup(store, members, 4).global_rank(2) == 4


def test_after_a_join_the_run_closes_over_the_store():
    """Every process finished, but a worker joined on the way: it is outside the run's first group,
    so the closing bookkeeping goes through the store over all of them; without a join, the group."""
    from distrain.algorithms.parameter_server import survivors_transport
    from distrain.runtime.health import FINISHED_KEY
    from distrain.runtime.membership import JOINS_KEY

    store = dist.HashStore()
    store.set(FINISHED_KEY.format(1), "1")
    assert survivors_transport(store, 0, 2, timeout=5) == (None, {})
    store.add(JOINS_KEY, 1)
    group, lost = survivors_transport(store, 0, 2, timeout=5)
    assert group is not None and group.members == [0, 1] and lost == {}


# --- a live process whose training thread is stuck ------------------------------------------------

def test_the_stuck_deadline_follows_the_measured_step_times_between_floor_and_ceiling(monkeypatch):
    from distrain.runtime import health

    monkeypatch.setattr(health, "STUCK_FLOOR_S", 30.0)
    assert health.stuck_deadline([0.01] * (health.STUCK_MIN_STEPS - 1), ceiling=120.0) == 120.0  # not measured yet
    assert health.stuck_deadline([0.01] * 100, ceiling=120.0) == 30.0  # fast steps: the floor
    steps = [1.0] * 99 + [5.0]  # one slow step in a hundred sets the 99th percentile
    assert health.stuck_deadline(steps, ceiling=120.0) == health.STUCK_FACTOR * 5.0
    assert health.stuck_deadline([20.0] * 10, ceiling=120.0) == 120.0  # never past --timeout


def _watch_thread(target, monkeypatch, seconds: float = 0.8) -> float:
    """Run ``target`` in a thread, watched with a floor of 0.2 s after measured fast steps, and
    return the longest time the watch found it stuck."""
    import threading
    import time

    from distrain.runtime import health

    monkeypatch.setattr(health, "STUCK_FLOOR_S", 0.2)
    started = threading.Event()

    def run():
        started.set()
        target(seconds)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(5)
    watch = health.StuckWatch(thread.ident, ceiling=60.0)
    watch.steps.extend([0.001] * 10)
    longest = 0.0
    while thread.is_alive():
        longest = max(longest, watch.stuck_for())
        time.sleep(0.05)
    thread.join()
    return longest


def test_a_thread_blocked_outside_any_wait_is_stuck(monkeypatch):
    import threading

    stuck = _watch_thread(lambda s: threading.Event().wait(s), monkeypatch)  # a lock that is never released
    assert stuck > 0.2


def test_a_thread_running_python_or_waiting_in_distrain_is_not_stuck(monkeypatch):
    """An evaluation loop runs Python (its place moves); distrain's own waits (here: for peers
    that never finish, polling the store) have deadlines of their own."""
    import time

    from distrain.errors import WorkerFailure
    from distrain.runtime.health import finishers

    def busy(seconds):
        end, total = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            total += sum(range(100))

    def waits_for_peers(seconds):
        try:
            finishers(dist.HashStore(), 0, 2, timeout=seconds)
        except WorkerFailure:
            pass

    assert _watch_thread(busy, monkeypatch) == 0.0
    assert _watch_thread(waits_for_peers, monkeypatch) == 0.0


def test_a_stuck_thread_stops_its_heartbeat_and_starts_it_again_when_it_moves(monkeypatch):
    import threading
    import time

    from distrain.runtime import health

    monkeypatch.setattr(health, "STUCK_FLOOR_S", 0.3)
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    release, made = threading.Event(), threading.Event()
    beats: list[Heartbeat] = []

    def worker():  # the watched thread: makes its heartbeat, steps, then blocks until released
        beats.append(Heartbeat("127.0.0.1", port, rank=1, world_size=2, interval=0.1, ceiling=60.0).start())
        for _ in range(10):
            beats[0].progress()
        made.set()
        release.wait(30)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert made.wait(10)
    other = Heartbeat("127.0.0.1", port, rank=0, world_size=2, interval=0.1).start()
    try:
        assert other.wait_for_suspects(patience=10) == [1]  # worker 1 is alive, but stuck: silent
        assert beats[0].stuck
        release.set()
        thread.join(5)
        deadline = time.monotonic() + 10
        while other.suspects() and time.monotonic() < deadline:  # its thread ended: nothing stuck, it stamps again
            time.sleep(0.05)
        assert other.suspects() == [] and not beats[0].stuck
    finally:
        other.stop()
        beats[0].stop()
    del master


def test_a_store_request_that_fails_does_not_stop_the_heartbeat(monkeypatch):
    """One stamp fails (a store slow to answer on a loaded host): the heartbeat tries again
    with a new client and the worker never looks silent. Before, the first failure ended the
    stamps for good, and 3 s later every peer took the live worker for dead."""
    import time

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    made = {"clients": 0}
    real_client = Heartbeat._client

    class Flaky:
        def __init__(self, store):
            self.store = store

        def set(self, key, value):
            raise RuntimeError("timed out")

    def client(self):
        made["clients"] += 1
        store = real_client(self)
        return Flaky(store) if made["clients"] == 2 else store  # the thread's first client fails once

    monkeypatch.setattr(Heartbeat, "_client", client)
    beat = Heartbeat("127.0.0.1", port, rank=1, world_size=2, interval=0.05).start()
    other = Heartbeat("127.0.0.1", port, rank=0, world_size=2, interval=0.05)
    try:
        deadline = time.monotonic() + 10
        while made["clients"] < 3 and time.monotonic() < deadline:  # the failed client was replaced
            time.sleep(0.01)
        assert made["clients"] >= 3
        time.sleep(0.5)  # let more stamps than the staleness window pass: not a synchronisation
        assert other.suspects(stale_after=0.3) == []  # worker 1 stamps on (a stopped one would be stale)
    finally:
        beat.stop()
    del master


@pytest.mark.slow  # the benchmarks' fault tool (bench_churn.py --kill-at time), not a path of a run
def test_a_timed_kill_strikes_the_named_rank_only_and_not_a_process_started_again(tmp_path):
    """DISTRAIN_INJECT_KILL_AFTER='rank:seconds' (benchmarks kill a process at a moment, not at a
    step): the named rank dies by SIGKILL with its mark written; another rank, or the same rank
    started again, is left alone."""
    import os
    import signal
    import subprocess
    import sys

    code = ("import sys, time; from distrain.runtime.faults import arm_timed_kill; "
            "arm_timed_kill(int(sys.argv[1])); time.sleep(2); print('alive')")

    def run(rank: int, **extra: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "DISTRAIN_INJECT_KILL_AFTER": "2:0.2", "DISTRAIN_INJECT_MARK": str(tmp_path / f"mark{rank}"),
               **extra}
        return subprocess.run([sys.executable, "-c", code, str(rank)], env=env, capture_output=True, text=True,
                              timeout=60)

    killed = run(2)
    assert killed.returncode == -signal.SIGKILL and (tmp_path / "mark2").exists()
    for done in (run(1), run(2, DISTRAIN_JOIN="1")):
        assert done.returncode == 0 and done.stdout.strip() == "alive", done.stderr
