"""Prague's election of a new group generator over a real TCPStore (no training)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distrain.algorithms.prague import GROUP, NO_GROUP, GroupBoard, GroupGenerator, GroupGossip
from distrain.launch.common import free_port
from distrain.runtime.health import Liveness


def _worker(rank: int, live: Liveness) -> GroupGossip:
    """A worker's gossip engine with only what an election reads (its generator is set, so an
    election of this worker starts no thread)."""
    lost: list[int] = []
    engine = object.__new__(GroupGossip)
    engine.rank, engine.generator_rank, engine.generator = rank, 0, object()
    engine._elect_lock = threading.RLock()
    engine.state = SimpleNamespace(world=4, mark_lost=lost.append, lost=lost)
    engine.liveness = live
    return engine


def test_a_lost_generator_started_again_is_not_elected_and_one_loss_elects_once():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    live = Liveness("127.0.0.1", port, world_size=4)
    worker = _worker(2, live)
    # Worker 0, the generator, was lost, started again and admitted before this worker looked:
    # no longer dead, it is still not the one to generate (its new life waits for another).
    assert live.dead_ranks() == {}
    assert worker._succeed(live, 0) == 1 and worker.generator_rank == 1
    # The same loss seen by a second thread of this worker: the generator elected stays.
    assert worker._succeed(live, 0) == 1 and worker.generator_rank == 1
    # Worker 1 is lost too, declared dead: the lowest live rank but the lost one, which is worker
    # 0's new life now (it runs the same election, and starts the generator).
    live.declare_dead(1)
    assert worker._succeed(live, 1) == 0 and worker.generator_rank == 0
    assert worker.state.lost == [1]
    del store


def test_a_successor_hands_out_a_lost_generators_group_only_to_the_lives_it_was_formed_for():
    """The lost generator formed group [0, 1] and told only worker 0 (itself) before it died. Its
    successor gives that group to worker 1 at its first READY (worker 0's old life waits for it in
    the ring), unless worker 0 has joined again since: its new life never heard of the group, and
    worker 1 would wait in a ring nobody else enters."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    live = Liveness("127.0.0.1", port, world_size=4)
    old = GroupGenerator(4, 2, control=None, liveness=live, rank=0)  # type: ignore[arg-type]
    GroupBoard(live.store).record([(1, old._answer(GROUP, [0, 1]))])  # as the old generator does
    for joined_again in (False, True):
        successor = GroupGenerator(4, 2, control=None, liveness=live, rank=1, successor=True)  # type: ignore[arg-type]
        if joined_again:
            successor.revive(0, epoch=1)  # worker 0 started again, admitted in epoch 1
        missed = successor._missed(1, NO_GROUP)
        if joined_again:
            assert missed is None
        else:
            assert missed is not None and missed[2:4].tolist() == [0, 1]
    del store


class _Route:
    """The generator's Transport to each worker: worker 2's connection has failed (a send to it
    raises as it is issued, as gloo's does on a failed connection); the others' take the message."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, tensor: torch.Tensor, dst: int) -> SimpleNamespace:
        if dst == 2:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:21916")
        self.sent.append(dst)
        return SimpleNamespace(wait=lambda: None)


def test_the_generator_answers_the_others_when_a_send_to_a_lost_worker_fails_as_it_is_issued():
    """The generator's listening thread saw worker 2's connection close before the generator
    answered a group with it: the send failed at once, and the generator's thread died with it
    (worker 0 then stopped, 1 of 20 restart runs of bench_churn's prague). It is the worker's loss."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    live = Liveness("127.0.0.1", port, world_size=4)
    route = _Route()
    answer = torch.zeros(4, dtype=torch.int64)
    generator = GroupGenerator(4, 2, control=None, liveness=live, rank=0, route=lambda _w: route)  # type: ignore[arg-type]
    generator.deliver([(2, answer), (1, answer), (0, answer)])
    assert route.sent == [1] and generator.local.get_nowait() is answer
    strict = GroupGenerator(4, 2, control=None, rank=0, route=lambda _w: route)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="Connection closed"):  # no liveness: a lost worker fails the run
        strict.deliver([(2, answer)])
    del store
