"""The silence watch of a process that waits for its peers, over a real TCPStore: it asks the
launcher to stop a peer that stays silent through its heartbeat's staleness, and only such a one."""

from __future__ import annotations

import time

from distrain.runtime.health import (
    FINISHED_KEY,
    KEY,
    SilenceWatch,
    declare_dead,
    request_fence,
    take_fence_request,
)
from tests.reliability.common import wait_for


def test_only_a_peer_waited_for_past_its_staleness_with_a_stale_heartbeat_is_to_be_stopped(store):
    now, stale = time.time(), 1.0
    store.set(KEY.format(1), repr(now + 60))  # stamping (its clock a little ahead does not matter)
    for rank in (2, 3, 4, 5):
        store.set(KEY.format(rank), repr(now - 30))  # stopped stamping
    store.set(FINISHED_KEY.format(3), "1")  # finished: its heartbeat ended with it
    declare_dead(store, 4)  # already lost: the wait fails without help
    since = time.monotonic() - 10
    awaited = {1: since, 3: since, 4: since, 5: time.monotonic() + 60, 2: since}  # 5: waited for only now
    watch = SilenceWatch(lambda: awaited, "server 0", stale_after=stale, poll=0.05).start()
    try:
        wait_for(lambda: 2 in watch.asked, 10, "the request for rank 2")  # (the last one each look reaches)
        why = take_fence_request(store, 2)
        assert why is not None and why.startswith("server 0 waited ") and "heartbeat had stopped" in why
        assert take_fence_request(store, 2) is None  # taken once: a process started in its place is left alone
        looks = watch.looks
        wait_for(lambda: watch.looks >= looks + 5, 10, "five more looks")  # at the same wait: nothing more asked
        assert take_fence_request(store, 2) is None
        assert list(watch.asked) == [2]
        for rank in (1, 3, 4, 5):
            assert take_fence_request(store, rank) is None, rank
        awaited[2] = time.monotonic() - 10  # another wait for it (a life started again, silent too)
        wait_for(lambda: take_fence_request(store, 2) is not None, 10, "the second request")
    finally:
        watch.close()


def test_the_first_reason_given_stands(store):
    request_fence(store, 7, "server 0 waited 3.1 s")
    request_fence(store, 7, "server 1 waited 3.2 s")
    assert take_fence_request(store, 7) == "server 0 waited 3.1 s"
    assert take_fence_request(store, 7) is None
