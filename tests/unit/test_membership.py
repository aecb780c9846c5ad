"""The membership protocol on an in-memory store: every survivor reads the same members, the
members agree on when to admit a joiner, and a joiner that comes too late is told so."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from distrain.runtime.health import KEY, declare_dead
from distrain.runtime.membership import (
    CLOSED_KEY,
    JOINS_KEY,
    RESTARTS_KEY,
    Growth,
    Membership,
    RunEnded,
)


def store_with_heartbeats(*workers: int) -> dist.HashStore:
    store = dist.HashStore()
    for w in workers:
        store.set(KEY.format(w), repr(time.time()))
    return store


def agree_all(members: list[Membership], steps: dict[int, int]) -> dict[int, tuple[list[int], dict[int, int]]]:
    out: dict[int, tuple[list[int], dict[int, int]]] = {}
    threads = [threading.Thread(target=lambda m=m: out.__setitem__(m.me, m.agree(steps[m.me]))) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return out


def test_survivors_agree_on_the_same_members_and_steps():
    store = store_with_heartbeats(0, 1, 2, 3)
    declare_dead(store, 2)  # the launcher saw it exit
    survivors = [Membership(store, [0, 1, 2, 3], me, timeout=10) for me in (0, 1, 3)]
    agreed = agree_all(survivors, {0: 7, 1: 7, 3: 8})
    assert agreed[0] == agreed[1] == agreed[3] == ([0, 1, 3], {0: 7, 1: 7, 3: 8})


def test_a_silent_member_is_left_out_and_a_late_one_reads_the_agreement():
    store = store_with_heartbeats(0, 1)  # worker 2 never stamped a heartbeat: silent
    first = Membership(store, [0, 1, 2], 0, timeout=10)
    second = Membership(store, [0, 1, 2], 1, timeout=10)
    started = time.monotonic()
    agreed = agree_all([first, second], {0: 3, 1: 3})
    assert agreed[0] == agreed[1] == ([0, 1], {0: 3, 1: 3})
    assert time.monotonic() - started < 5  # by its silence, not by the 10 s deadline
    late = Membership(store, [0, 1, 2], 2, timeout=10)  # it resumes: the agreement exists, without it
    assert late.agree(3) == ([0, 1], {0: 3, 1: 3})


def test_the_first_proposal_to_admit_a_joiner_is_everyones():
    store = dist.HashStore()
    store.set(RESTARTS_KEY, "1")
    a, b = Membership(store, [0, 1, 2], 0), Membership(store, [0, 1, 2], 1)
    assert a.planned_growth(10) is None  # nobody waits
    store.add(JOINS_KEY, 1)
    assert a.planned_growth(10) == Growth(12, 1)  # two steps on: nobody has passed it when it learns it
    assert b.planned_growth(11) == Growth(12, 1)


def test_a_round_based_algorithm_admits_at_a_rounds_end():
    store = dist.HashStore()
    store.set(RESTARTS_KEY, "1")
    store.add(JOINS_KEY, 1)
    m = Membership(store, [0, 1], 0)
    assert m.planned_growth(13, lambda at: -(-at // 4) * 4) == Growth(16, 1)


def test_without_restarts_the_members_never_ask():
    store = dist.HashStore()
    store.add(JOINS_KEY, 1)
    assert Membership(store, [0, 1], 0).planned_growth(5) is None


def test_a_joiner_after_the_end_is_told_so():
    store = dist.HashStore()
    store.set(CLOSED_KEY, "1")
    started = time.monotonic()
    with pytest.raises(RunEnded, match="finished training"):
        Membership.enter(store, 2, timeout=30)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("algorithm", ["allreduce", "ps"])
def test_the_survivors_split_every_sample_between_them(algorithm):
    """After a loss, the survivors (worker ids 0, 2, 3) each take one part of the training set
    split three ways, together all of it. All-reduce scales the learning rate to their global
    batch; the parameter servers already do (they divide the survivors' sum by --workers)."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from distrain.algorithms import ALGORITHMS
    from distrain.config import TrainConfig
    from distrain.train.loop import lr_schedule, regroup

    cfg = TrainConfig.from_dict({"algorithm": algorithm, "workers": 4, "batch_size": 8, "lr": 0.1,
                                 "reference_batch": 8})
    data = TensorDataset(torch.zeros(120, 1), torch.zeros(120, dtype=torch.long))
    before, _ = lr_schedule(cfg, 4, 0, 100)
    seen = []
    for me in (0, 2, 3):
        opt = SimpleNamespace(workers=3, ids=[0, 2, 3], id=me, algorithm=ALGORITHMS[algorithm])
        sampler, schedule, global_batch = regroup(cfg, opt, data, before)  # type: ignore[arg-type]
        seen += sampler.indices.tolist()
        assert global_batch == 24
        assert (schedule is before) == (algorithm == "ps")
        assert schedule.peak_lr == pytest.approx(before.peak_lr * (1 if algorithm == "ps" else 3 / 4))
    assert sorted(seen) == list(range(120))
