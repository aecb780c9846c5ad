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
    ADMIT_KEY,
    CLOSED_KEY,
    JOINER_KEY,
    JOINS_KEY,
    RESTARTS_KEY,
    Growth,
    Membership,
    MembershipChanged,
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


def test_asynchronous_members_admit_at_once_until_one_closes_the_run():
    """Asynchronous gossip: the first member to see a joiner proposes to admit it now, and a member
    that closes later admits it first; once one closed, nobody admits and the joiner is told."""
    store = dist.HashStore()
    store.set(RESTARTS_KEY, "1")
    a, b = Membership(store, [0, 1, 2], 0), Membership(store, [0, 1, 2], 1)
    assert a.growth_now() is None  # nobody waits
    store.add(JOINS_KEY, 1)
    store.set(JOINER_KEY.format(0), "2")
    assert a.growth_now() == Growth(0, 1)  # a's proposal: it names a
    assert b.close_growth() == Growth(0, 1)  # b closes after the agreement: it admits first
    for m in (a, b):
        change = m.admit(m.growth, 5, time.perf_counter(), live=[0, 1])  # type: ignore[arg-type]
        assert (change.members, change.joined, change.epoch) == ([0, 1, 2], [2], 1)
    assert b.close_growth() is None and store.check([CLOSED_KEY])
    store.add(JOINS_KEY, 1)
    store.set(JOINER_KEY.format(1), "1")
    assert a.growth_now() is None  # closed at this epoch: a later joiner is not admitted
    assert a.close_growth() is None
    with pytest.raises(RunEnded):
        Membership.enter(store, 1, reopen=False, timeout=5)


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


def test_workers_and_servers_admit_a_joiner_together_in_order_of_ids():
    """A parameter-server run: worker 0 was lost and asks to join again. A server (rank 4, which
    serves workers 1-3) and a worker that has not read the loss yet (so counts worker 0 live) see
    it at different steps, agree on one step, and both name the same members, worker 0 among them,
    in order of their ids; the joiner reads its epoch and the members without opening a group."""
    store = dist.HashStore()
    store.set(RESTARTS_KEY, "1")
    declare_dead(store, 0)
    server, worker = Membership(store, [0, 1, 2, 3], 4), Membership(store, [0, 1, 2, 3], 2)
    entered: list[Membership] = []
    joiner = threading.Thread(target=lambda: entered.append(Membership.enter(store, 0, reopen=False, timeout=10)))
    joiner.start()
    while not store.check([JOINER_KEY.format(0)]):  # it asked
        time.sleep(0.01)
    assert server.planned_growth(7) == worker.planned_growth(6) == Growth(9, 1)
    by_server = server.admit(Growth(9, 1), 9, time.perf_counter(), live=[1, 2, 3])
    by_worker = worker.admit(Growth(9, 1), 9, time.perf_counter(), live=[0, 1, 2, 3])
    for change in (by_server, by_worker):
        assert (change.members, change.joined, change.lost, change.step, change.epoch) == ([0, 1, 2, 3], [0], [], 9, 1)
        assert change.record()["event"] == "joined" and change.record()["joined_at_step"] == 9
    joiner.join(timeout=10)
    [admitted] = entered
    assert (admitted.epoch, admitted.members, admitted.admitted) == (1, [0, 1, 2, 3], 1)
    assert not dist.is_initialized() and not store.check(["distrain/0/dead/0"])  # alive again
    assert server.planned_growth(10) is None  # nobody else waits


class AdmittedWhileLooking:
    """A store in which the members admit the joiner, then close, between its first look for its
    admission and its look for the run's end."""

    def __init__(self, store: dist.HashStore, admit: object) -> None:
        self.store, self.admit, self.looked = store, admit, False

    def check(self, keys: list[str]) -> bool:
        if keys == [ADMIT_KEY.format(0)] and not self.looked:
            self.looked = True
            self.admit()
            return False
        return self.store.check(keys)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def test_a_joiner_admitted_just_before_the_members_closed_still_joins():
    store = dist.HashStore()
    store.set(RESTARTS_KEY, "1")
    member = Membership(store, [0, 1, 2], 0)

    def admit_and_close() -> None:
        member.admit(member.planned_growth(5), 7, time.perf_counter(), live=[0, 1, 2])  # type: ignore[arg-type]
        member.close()

    joiner = Membership.enter(AdmittedWhileLooking(store, admit_and_close), 3, reopen=False, timeout=5)  # type: ignore[arg-type]
    assert joiner.members == [0, 1, 2, 3] and joiner.epoch == 1


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


def test_after_a_join_every_worker_trains_on_its_first_shard_again():
    """A parameter-server run admits a joiner with the members in order of their ids: the split
    over the four is the first one, so the joiner gets its own shard back and so does everyone."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from distrain.algorithms import ALGORITHMS
    from distrain.config import TrainConfig
    from distrain.train.loop import lr_schedule, regroup, split

    cfg = TrainConfig.from_dict({"algorithm": "ps", "workers": 4, "batch_size": 8})
    data = TensorDataset(torch.zeros(120, 1), torch.zeros(120, dtype=torch.long))
    first = split(cfg, data, 4)
    schedule, _ = lr_schedule(cfg, 4, 0, 100)
    for me in range(4):
        opt = SimpleNamespace(workers=4, ids=[0, 1, 2, 3], id=me, algorithm=ALGORITHMS["ps"])
        sampler, _, global_batch = regroup(cfg, opt, data, schedule)  # type: ignore[arg-type]
        assert sampler.indices.tolist() == first[me].tolist() and global_batch == 32


@pytest.mark.parametrize("algorithm,kept", [("allreduce", 6), ("diloco", 4)])
def test_after_a_loss_the_epoch_under_way_gives_every_sample(algorithm, kept):
    """Worker 1 is lost when the others had done 6 steps, and they go on from step 7 (they redid
    the interrupted one): its samples after the steps the model holds (all 6 of all-reduce's; of
    DiLoCo's, syncing every 4, the first round's 4) are dealt out to the survivors, who finish the
    epoch (steps 4-7 of 32 samples a worker) before they start the training set split in three."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from distrain.assemble import build_algorithm
    from distrain.config import TrainConfig
    from distrain.runtime.membership import Change
    from distrain.train.loop import replan, split

    cfg = TrainConfig.from_dict({"algorithm": algorithm, "workers": 4, "batch_size": 8, "sync_every": 4})
    data = TensorDataset(torch.zeros(128, 1), torch.zeros(128, dtype=torch.long))
    lost = Change(epoch=1, members=[0, 2, 3], lost=[1], steps={0: 6, 2: 6, 3: 6}, at=0.0, seconds=0.0, step=6)
    samplers, views = {}, []
    for me in (0, 2, 3):
        opt = SimpleNamespace(algorithm=build_algorithm(algorithm, cfg), id=me, membership=None, joins=None)
        assert opt.algorithm.kept_steps(6) == kept
        plan = replan(cfg, opt, data, None, [lost], 7, 4)  # type: ignore[arg-type]
        samplers[me] = plan.samplers[me]
        views.append({m: s.carry.tolist() for m, s in plan.samplers.items()})
    assert views[0] == views[1] == views[2]  # every survivor makes the same plan
    first = replan(cfg, SimpleNamespace(algorithm=build_algorithm(algorithm, cfg), id=0, membership=None, joins=None),
                   data, None, [], 0, 4)  # type: ignore[arg-type]
    epoch = [i for r in (0, 2, 3) for s in range(4, 7) for i in first.samplers[r].batch(s).tolist()]
    epoch += [i for s in range(4, kept) for i in first.samplers[1].batch(s).tolist()]
    epoch += [i for m in (0, 2, 3) for i in samplers[m].carry.tolist()]
    assert sorted(epoch) == list(range(128))
    parts = split(cfg, data, 3)
    for i, m in enumerate((0, 2, 3)):  # then the training set in three
        s = samplers[m]
        after = [j for step in range(7, 30) for j in s.batch(step).tolist()][len(s.carry):len(s.carry) + len(parts[i])]
        assert sorted(after) == sorted(parts[i].tolist())


def test_members_that_look_every_few_steps_agree_before_any_passes_the_step():
    """Looking for joiners every 8 steps: the first member to see one (at step 16) proposes step
    24; one a step behind learns it at 16, one a step ahead at 24 itself, and none looks between."""
    store = dist.HashStore()
    store.set(RESTARTS_KEY, "1")
    members = [Membership(store, [0, 1, 2], me) for me in range(3)]
    store.add(JOINS_KEY, 1)
    assert members[0].planned_growth(15, every=8) is None  # not a step to look at
    assert members[0].planned_growth(16, every=8) == Growth(24, 1)
    assert members[1].planned_growth(16, every=8) == Growth(24, 1)
    assert members[2].planned_growth(17, every=8) is None and members[2].planned_growth(23, every=8) is None
    assert members[2].planned_growth(24, every=8) == Growth(24, 1)


def test_a_users_shard_after_a_loss_is_the_split_over_the_members():
    """wrap()'s shard() splits over the members at the time of the call: after worker 1 was lost,
    the three survivors' shards (by their new ranks) are the training set split three ways."""
    from torch.utils.data import TensorDataset

    from distrain.config import TrainConfig
    from distrain.distributed import DistributedOptimizer
    from distrain.train.loop import split

    cfg = TrainConfig.from_dict({"workers": 4, "batch_size": 8})
    data = TensorDataset(torch.zeros(120, 1), torch.zeros(120, dtype=torch.long))
    seen = []
    for rank in range(3):  # ids 0, 2, 3 after the loss
        opt = DistributedOptimizer.__new__(DistributedOptimizer)
        opt.config, opt.rank, opt.workers, opt.steps_per_epoch, opt.total_steps = cfg, rank, 3, 5, 20
        part = opt.shard(data).indices
        assert part == split(cfg, data, 3)[rank].tolist() and opt.total_steps == 20
        seen += part
    assert sorted(seen) == list(range(120))


@pytest.mark.parametrize("lost_at,kept", [(2, 0), (3, 0), (5, 2), (6, 2), (7, 4), (8, 4), (9, 6)])
def test_streaming_diloco_keeps_the_steps_every_fragment_synced(lost_at, kept):
    """Two fragments synced at step counts 2 and 0 modulo 4, each exchange applied a step after
    its sync: a worker lost when the others had done ``lost_at`` steps (found at an exchange
    begun at ``lost_at + 1``, or waited for there) is in the model up to the last sync whose
    exchange had completed before, in every fragment: the fewest steps over the fragments
    (after 6 steps, say, the exchange begun at 6 is lost; those begun at 2 and 4 completed)."""
    from distrain.assemble import build_algorithm
    from distrain.config import TrainConfig

    cfg = TrainConfig.from_dict({"algorithm": "diloco", "workers": 4, "sync_every": 4, "fragments": 2,
                                 "overlap_steps": 1})
    assert build_algorithm("diloco", cfg).kept_steps(lost_at) == kept


@pytest.mark.parametrize("overlap,lost_at,kept", [(0, 6, 2), (0, 7, 6), (1, 6, 2), (1, 7, 6), (2, 7, 2), (2, 8, 6)])
def test_diloco_with_auto_h_keeps_the_last_round_whose_exchange_completed(overlap, lost_at, kept):
    """--sync-every auto, rounds ended at step counts 2 and 6: a worker lost at the sync of 6
    (found there, after 6 steps), or at its wait ``--overlap-steps`` later (found in the step
    after ``lost_at``), is in the model up to step 2; once that exchange completed, up to 6."""
    from distrain.assemble import build_algorithm
    from distrain.config import TrainConfig

    cfg = TrainConfig.from_dict({"algorithm": "diloco", "workers": 4, "sync_every": "auto", "sync_every_min": 3,
                                 "overlap_steps": overlap})
    algorithm = build_algorithm("diloco", cfg)
    algorithm.synced_at, algorithm.previous_sync = [6], 2
    assert algorithm.kept_steps(lost_at) == kept


@pytest.mark.parametrize("sync_every,overlap,admitted", [(8, 0, 8), (8, 2, 16), ("auto", 0, 8), ("auto", 2, 16)])
def test_diloco_admits_joiners_at_a_rounds_end_no_member_can_have_passed(sync_every, overlap, admitted):
    """The proposer stands at inner step 6 and proposes step 8, the next round's end (H = 8).
    With --overlap-steps 2 a member waits for that sync's exchange only at step 10, so one ahead
    may already have passed step 8 and looked for joiners there: the admission goes to the
    round's end after step 10, 16. Without an overlap every member waits within step 8."""
    from distrain.algorithms.diloco import sync_offsets
    from distrain.assemble import build_algorithm
    from distrain.config import TrainConfig

    cfg = TrainConfig.from_dict({"algorithm": "diloco", "workers": 4, "sync_every": sync_every, "sync_every_min": 8,
                                 "overlap_steps": overlap})
    algorithm = build_algorithm("diloco", cfg)
    algorithm.inner_steps, algorithm.offsets = 6, sync_offsets(8, 1)
    if sync_every == "auto":
        algorithm.sync_every, algorithm.next_sync = 8, 8
    assert algorithm.admission_step(8) == admitted


def test_a_member_started_again_and_asking_to_join_is_not_waited_for():
    """Worker 2 died and its new life asks to join (alive: its heartbeat stamps, no dead mark):
    the survivors of its loss do not wait for it to register, it is not a member any more."""
    store = store_with_heartbeats(0, 1, 2)
    store.set(JOINER_KEY.format(int(store.add(JOINS_KEY, 1)) - 1), "2")
    survivors = [Membership(store, [0, 1, 2], me, timeout=10) for me in (0, 1)]
    started = time.monotonic()
    agreed = agree_all(survivors, {0: 5, 1: 5})
    assert agreed[0] == agreed[1] == ([0, 1], {0: 5, 1: 5})
    assert time.monotonic() - started < 5  # not the 10 s deadline


def test_members_open_a_group_only_when_every_one_is_ready():
    """_meet: each member marks itself ready and waits for the others; one that died before it
    was ready makes the others leave at once with MembershipChanged (and the change flagged),
    instead of waiting in the group's rendezvous."""
    store = store_with_heartbeats(0, 1, 2)
    ready = [Membership(store, [0, 1], me, timeout=10) for me in (0, 1)]
    threads = [threading.Thread(target=m._meet) for m in ready]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)

    store = store_with_heartbeats(0, 1, 2)
    declare_dead(store, 2)
    member = Membership(store, [0, 1, 2], 0, epoch=3, timeout=10)
    started = time.monotonic()
    with pytest.raises(MembershipChanged, match=r"\[2\] gone"):
        member._meet()
    assert time.monotonic() - started < 5
    assert Membership(store, [0, 1, 2], 1, epoch=3, timeout=10).changed()  # the others see the flag
    with pytest.raises(MembershipChanged, match="flagged"):
        Membership(store, [0, 1, 2], 1, epoch=3, timeout=10)._meet()


def test_a_loss_while_a_group_opens_is_recovered_from_until_one_opens():
    """settle: a loss raised while a change opens its group (here worker 2 dies as it opens) makes
    this member recover over whoever is left, with its steps, and the changes on the way are
    returned (the group is not opened for real: _reopen only records the members)."""
    store = store_with_heartbeats(0, 1, 2)
    member = Membership(store, [0, 1, 2], 0, timeout=10)
    opened: list[list[int]] = []
    member._reopen = lambda: opened.append(list(member.members))  # type: ignore[method-assign]

    def grow() -> None:
        declare_dead(store, 2)
        raise MembershipChanged("worker 2 gone while the group opened")

    helper = Membership(store, [0, 1, 2], 1, timeout=10)
    agreed = threading.Thread(target=lambda: helper.agree(4))
    agreed.start()
    changes = member.settle(grow, 4)
    agreed.join(timeout=10)
    assert [(c.members, c.lost, c.steps) for c in changes] == [([0, 1], [2], {0: 4, 1: 4})]
    assert opened == [[0, 1]] and member.epoch == 1


def test_a_joiner_admitted_in_an_epoch_is_lost_again_when_its_heartbeat_stops_or_a_later_life_asks():
    """lost_again(worker, epoch): the life an epoch admitted is gone once its heartbeat is stale,
    or once a later life of the same worker has asked to join (its fresh heartbeat then says
    nothing of the earlier life); a life admitted later is not."""
    store = store_with_heartbeats(2)
    store.set(RESTARTS_KEY, "1")
    server = Membership(store, [0, 1, 2, 3], 4, stale_after=3.0)
    store.set(JOINER_KEY.format(int(store.add(JOINS_KEY, 1)) - 1), "2")  # worker 2's second life asks
    server.admit(Growth(5, 1), 5, time.perf_counter(), live=[0, 1, 3])
    assert server.lives == {(2, 1): 1}
    assert not server.lost_again(2, 1)
    store.set(JOINER_KEY.format(int(store.add(JOINS_KEY, 1)) - 1), "2")  # it died; its third life asks
    assert server.lost_again(2, 1)
    server.admit(Growth(6, 2), 6, time.perf_counter(), live=[0, 1, 3])
    assert not server.lost_again(2, 2)  # the third life, admitted in epoch 2
    store.set(KEY.format(2), repr(time.time() - 10))  # its heartbeat stops
    assert server.lost_again(2, 2)
