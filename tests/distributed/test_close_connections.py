"""A worker that leaves a group closes its connections there (``close_connections``), so that its
pending receives and its live peers' receives from it fail at once rather than at the group's
timeout, even where the peer it asks first is dead; and a wait its caller abandons never holds
the process's later waits (``wait_polling``)."""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from distrain.runtime import membership
from distrain.runtime.membership import close_connections, wait_polling
from tests.harness import run_group

#: Each wait's own bound: far beyond a closed connection's failure (milliseconds), so that a
#: wait still pending after a close shows as a timeout, not as a slow failure.
WAIT_S = 20.0


def _wait(work: dist.Work) -> tuple[float, str]:
    """Seconds until ``work`` failed (or finished), and the error's text ('' if it finished)."""
    began = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=WAIT_S))
        return time.monotonic() - began, ""
    except RuntimeError as exc:
        return time.monotonic() - began, str(exc)


def _close_behind_a_dead_peer(rank: int, world: int) -> dict:
    """Rank 1 leaves (its process ends, its connections reset). Rank 0, whose first choice of
    a peer to time out is rank 1, closes its connections; its own receive from rank 2 and rank
    2's receive from it must then fail at once."""
    dist.barrier()
    if rank == 1:
        return {"seconds": torch.tensor(0.0), "timed_out": torch.tensor(False)}
    if rank == 2:
        seconds, error = _wait(dist.irecv(torch.zeros(1), src=0))
        return {"seconds": torch.tensor(seconds), "timed_out": torch.tensor("Timed out" in error or not error)}
    pending = dist.irecv(torch.zeros(1), src=2)
    _, error = _wait(dist.irecv(torch.zeros(1), src=1))  # ends as rank 1's process does
    assert error and "Timed out" not in error, error
    close_connections()  # its first try, rank 1, fails at once and closes nothing
    seconds, error = _wait(pending)
    return {"seconds": torch.tensor(seconds), "timed_out": torch.tensor("Timed out" in error or not error)}


def test_closing_a_group_behind_a_dead_peer_ends_every_pending_receive_at_once():
    results = run_group(_close_behind_a_dead_peer, world=3, timeout=60.0)
    for rank in (0, 2):
        assert not bool(results[rank]["timed_out"]), f"rank {rank}'s receive was still pending after the close"
        assert float(results[rank]["seconds"]) < WAIT_S / 4


def test_a_wait_left_by_its_caller_does_not_hold_the_next_one():
    release = threading.Event()
    stuck = membership._waiter()

    def first_poll(_waited: float) -> None:
        raise TimeoutError("the caller leaves")

    try:
        try:
            wait_polling(lambda: release.wait(60), first_poll, every=0.01)
        except TimeoutError:
            pass
        else:
            raise AssertionError("the poll's exception was not raised")
        finished = threading.Event()
        threading.Thread(target=lambda: (wait_polling(lambda: None, lambda _w: None, every=0.01), finished.set()),
                         daemon=True).start()
        assert finished.wait(10), "the next wait queued behind the abandoned one"
        assert membership._waiter() is not stuck
    finally:
        release.set()
    stuck.thread.join(10)
    assert not stuck.thread.is_alive(), "the abandoned waiter's thread did not end after its wait"
