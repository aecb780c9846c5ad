"""The wait watch of a run that stops on any lost peer, over a real TCPStore: once a wait has
lasted the heartbeat's staleness, a peer that stamped and then stopped (or was declared dead)
ends it with a communication error naming that peer; a peer still stamping, one that has not
stamped yet and one that finished do not."""

from __future__ import annotations

import time

import pytest

from distrain.runtime.faults import PeerTimeout, is_comm_error
from distrain.runtime.health import FINISHED_KEY, KEY, HungPeers, declare_dead


def test_a_peer_that_stopped_stamping_ends_a_wait_once_it_lasted_the_staleness(store):
    now = time.time()
    store.set(KEY.format(1), repr(now))  # stamping
    store.set(KEY.format(3), repr(now - 30))  # stamped, then stopped
    # (rank 2 has stamped nothing yet: still importing, it is not suspected)
    called = []
    watch = HungPeers.from_env(0, [0, 1, 2, 3], stale_after=3.0, every=0.0, on_hung=lambda: called.append(1))
    assert watch is not None and watch.peers == [1, 2, 3]
    assert watch(2.9) is False and called == []  # the wait has not lasted the staleness: nobody looked
    with pytest.raises(PeerTimeout) as raised:
        watch(3.5)
    message = str(raised.value)
    assert message.startswith("rank 3 has stamped no heartbeat for ") and "rank 0 waited 3.5 s" in message
    assert is_comm_error(raised.value)  # a lost peer, reported as one
    assert called == [1]  # (before the wait ends: its connections close)


def test_stamping_unstamped_and_finished_peers_leave_the_wait_alone_and_a_dead_one_ends_it(store):
    now = time.time()
    store.set(KEY.format(1), repr(now + 60))  # stamping (a clock ahead)
    store.set(KEY.format(3), repr(now - 30))
    store.set(FINISHED_KEY.format(3), "1")  # finished: its heartbeat ended with it
    watch = HungPeers.from_env(0, [0, 1, 2, 3], stale_after=3.0, every=0.0)
    assert watch is not None
    assert watch(60.0) is False and watch.hung() == []
    declare_dead(store, 2)
    with pytest.raises(PeerTimeout, match="^rank 2 was declared dead while rank 0 waited"):
        watch(61.0)


def test_it_looks_at_most_every_so_often_and_needs_a_store_and_a_peer(store, monkeypatch):
    store.set(KEY.format(1), repr(time.time() - 30))
    watch = HungPeers.from_env(0, [0, 1], stale_after=3.0, every=3600.0)
    assert watch is not None
    with pytest.raises(PeerTimeout):
        watch(4.0)
    assert watch(5.0) is False  # looked a moment ago: the next look is an hour away
    assert HungPeers.from_env(0, [0]) is None  # alone: nobody to wait for
    monkeypatch.delenv("MASTER_ADDR")
    assert HungPeers.from_env(0, [0, 1]) is None  # no store
