"""The asynchronous gossip machinery on one process: shared model, budgets, snapshots, groups, settings."""

from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch

from distrain.algorithms.gossip import Budget, SharedModel, Snapshots, snapshot_limit
from distrain.algorithms.prague import GROUP, NO_GROUP, STOP, GroupGenerator, group_size_for
from distrain.config import TrainConfig
from distrain.errors import ConfigError, WorkerFailure


def test_pairwise_mix_keeps_the_sum_and_an_update_made_meanwhile():
    a, b = SharedModel(torch.tensor([1.0, 2.0]), 0, 2), SharedModel(torch.tensor([5.0, -2.0]), 1, 2)
    sent_a, sent_b = a.read(), b.read()
    scratch = torch.empty(2)
    a.apply_step(torch.tensor([0.5, 0.0]), scratch)  # lands while the exchange is in flight
    a.mix(sent_a, (sent_a + sent_b) / 2)
    b.mix(sent_b, (sent_a + sent_b) / 2)
    torch.testing.assert_close(a.x, torch.tensor([3.5, 0.0]))  # the average plus the whole update
    torch.testing.assert_close(b.x, torch.tensor([3.0, 0.0]))
    torch.testing.assert_close(a.x + b.x, torch.tensor([6.5, 0.0]))
    assert a.counts == [1, 0] and a.rounds == 1


def test_lag_bound_waits_for_an_averaging_and_never_hangs():
    state = SharedModel(torch.zeros(2), 0, 2)
    scratch = torch.empty(2)
    state.apply_step(torch.ones(2), scratch)
    assert state.wait_for_averaging(2, timeout=5.0, failed=lambda: False)  # 1 step since the last averaging
    assert state.wait_for_averaging(0, timeout=0.0, failed=lambda: False)  # 0: no bound
    state.apply_step(torch.ones(2), scratch)
    assert not state.wait_for_averaging(2, timeout=0.05, failed=lambda: False)  # nobody averages: gives up
    assert state.wait_for_averaging(2, timeout=5.0, failed=lambda: True)  # the gossip failed: stop waiting

    # Another thread averages while the main thread waits: the wait ends with that averaging.
    waiting = threading.Event()
    result: list[bool] = []

    def main_thread() -> None:
        waiting.set()
        result.append(state.wait_for_averaging(2, timeout=30.0, failed=lambda: False))

    thread = threading.Thread(target=main_thread)
    thread.start()
    waiting.wait(5.0)
    sent = state.read()
    state.mix(sent, sent * 0.5)
    thread.join(30.0)
    assert result == [True] and not thread.is_alive()
    assert state.steps_at_round == 2 and state.rounds == 1
    state.apply_step(torch.ones(2), scratch)
    assert state.wait_for_averaging(2, timeout=0.0, failed=lambda: False)  # one step since that averaging


def test_progress_headers_merge_by_maximum():
    a, b = SharedModel(torch.zeros(1), 0, 3), SharedModel(torch.zeros(1), 2, 3)
    scratch = torch.empty(1)
    for _ in range(4):
        a.apply_step(torch.zeros(1), scratch)
    b.apply_step(torch.zeros(1), scratch)
    b.finish()
    header = b.progress_header(7)
    assert header.tolist() == [7, 0, 0, 1, 0, 0, 1]
    a.merge(header[1:])
    assert a.counts == [4, 0, 1] and a.done == [0, 0, 1] and a.global_steps() == 5 and not a.all_done
    a.finish()
    a.merge(torch.tensor([0, 0, 0, 0, 1, 0]))  # worker 1 is done too
    assert a.all_done
    with pytest.raises(WorkerFailure):
        a.merge(torch.zeros(5, dtype=torch.int64))


def test_a_worker_that_joins_again_is_not_done_until_it_finishes_its_next_life():
    """Worker 1 is lost (done), then joins again: every worker that merges the news counts it
    training again, whatever it knew before; its finish ends the run again. Its life is named by
    the admission's epoch: a member that reads the admission after it merged the news, or after
    the joiner finished, keeps the joiner's life as it is."""
    a, b = SharedModel(torch.zeros(1), 0, 2), SharedModel(torch.zeros(1), 1, 2)
    a.finish()
    a.mark_lost(1)
    assert a.all_done and a.lost == {1}
    a.revive(1, epoch=1)
    assert a.done == [1, 2] and not a.all_done and a.lost == set()
    b.merge(a.progress_header()[:])  # the joiner learns its life from a member's header
    assert b.done == [1, 2] and not b.finished
    stale = SharedModel(torch.zeros(1), 0, 2)
    stale.mark_lost(1)  # a member that has not read the admission yet
    stale.merge(a.progress_header())
    assert stale.done[1] == 2 and not stale.all_done
    stale.revive(1, epoch=1)  # it reads the admission after the news: the same life
    assert stale.done[1] == 2
    b.finish()
    a.merge(b.progress_header())
    assert a.done == [1, 3] and a.all_done
    a.revive(1, epoch=1)  # read late, after the joiner finished: it stays done
    assert a.done == [1, 3] and a.all_done
    a.mark_lost(1)  # lost again: still done, and a second join (a later epoch) is its next life
    a.revive(1, epoch=3)
    assert a.done == [1, 6] and a.lost == set()
    late = SharedModel(torch.zeros(1), 0, 2)
    late.mark_lost(1)
    late.merge(torch.tensor([0, 0, 0, 3]))  # the news that the joiner finished its next life came first
    late.revive(1, epoch=1)
    assert late.done[1] == 3 and late.lost == set()  # done, but not lost: its calls are answered
    again = SharedModel(torch.zeros(1), 0, 2)
    again.merge(torch.tensor([0, 0, 0, 2]))  # the news of its next life, then its loss in that life here
    again.mark_lost(1)
    again.revive(1, epoch=1)  # a late read of that admission: it stays lost
    assert again.done[1] == 3 and again.lost == {1}


def test_a_joiners_snapshots_start_after_it_joined():
    early, late = Snapshots(interval=1.0, limit=100), Snapshots(interval=1.0, limit=100)
    late.start_at(3.5)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        early.take(t, 0, torch.zeros(1))
        if t > 3.5:
            late.take(t, 0, torch.zeros(1))
    assert sorted(late.points) == [4, 5]
    assert early.common_points(0, min(early.last, late.last), max(early.first, late.first)) == [4, 5]


@pytest.mark.parametrize("kind,expected", [("local", (0.5, 50)), ("time", (0.25, 25)), ("global", (0.75, 75))])
def test_budget_progress_and_schedule(kind, expected):
    budget = Budget(kind, steps=100, world=4, seconds=40.0)
    # own step 50, all workers together 300 of 400 steps, 10 of 40 seconds
    assert budget.progress(50, 300, 10.0) == expected[0]
    assert budget.schedule_step(50, 300, 10.0) == expected[1]
    assert budget.schedule_step(100, 10_000, 1e6) <= 99 or kind == "local"


def test_snapshots_cover_every_point_and_thin_out_the_same_way_for_every_clock():
    a, b = Snapshots(interval=1.0, limit=4), Snapshots(interval=1.0, limit=4)
    for t in [0.5, 1.01, 1.5, 3.2, 4.0, 7.7, 9.1]:  # a slow worker: one step spans several points
        if a.due(t):
            a.take(t, int(t), torch.tensor([t]))
    for t in [x / 10 for x in range(1, 95)]:  # a fast worker
        if b.due(t):
            b.take(t, int(t), torch.tensor([t]))
    assert a.level == b.level == 1 and sorted(a.points) == sorted(b.points) == [2, 4, 6, 8]
    assert a.points[2].seconds == 3.2 and a.points[6].seconds == 7.7  # the first step boundary past the point
    assert b.points[4].seconds == pytest.approx(4.0)
    assert a.common_points(1, min(a.last, b.last)) == [2, 4, 6, 8]
    assert snapshot_limit(4) == 512 and snapshot_limit(2**30) == 8


def generator(world: int, size: int, seed: int = 0) -> GroupGenerator:
    return GroupGenerator(world, size, control=None, seed=seed)  # type: ignore[arg-type]


def ready(gen: GroupGenerator, worker: int, steps: int = 0, done: bool = False, ring_s: float = 0.0,
          now: float | None = None) -> list:
    message = [round(ring_s * 1e6), NO_GROUP] + [0] * (2 * gen.world)
    message[2 + worker], message[2 + gen.world + worker] = steps, int(done)
    return gen.on_ready(worker, torch.tensor(message), now=now)


def test_generator_groups_ready_workers_without_overlap_and_mixes_everyone():
    gen = generator(world=6, size=3, seed=1)
    rng = random.Random(0)
    waiting, busy, pairs = list(range(6)), set(), set()
    for _ in range(300):
        worker = waiting.pop(rng.randrange(len(waiting))) if waiting else None
        if worker is None:
            break
        for member, answer in ready(gen, worker):
            assert int(answer[0]) == GROUP and member not in busy
            members = answer[2 : 2 + int(answer[1])].tolist()
            assert len(members) == 3 and member in members
            pairs.update(itertools.combinations(sorted(members), 2))
            busy.add(member)
        if len(busy) == 6 or rng.random() < 0.5:  # some groups finish; their workers are ready again
            waiting += sorted(busy)
            busy.clear()
    assert pairs == set(itertools.combinations(range(6), 2))  # every pair has met


def test_generator_stops_everyone_once_all_are_done_and_refuses_duplicates():
    gen = generator(world=3, size=3)
    assert ready(gen, 0, steps=5, done=True) == []
    assert ready(gen, 1, steps=3, done=True) == []
    with pytest.raises(WorkerFailure):
        ready(gen, 1)
    answers = ready(gen, 2, steps=4, done=True)
    assert sorted(w for w, _ in answers) == [0, 1, 2]
    for _, answer in answers:
        assert int(answer[0]) == STOP and answer[-6:].tolist() == [5, 3, 4, 1, 1, 1]
    assert generator(world=2, size=3).size == 2  # groups never exceed the world


def test_default_group_size_leaves_room_for_two_groups():
    assert [group_size_for(0, n) for n in (2, 3, 4, 5, 6, 8, 16)] == [2, 2, 2, 2, 3, 3, 3]
    assert group_size_for(4, 8) == 4 and group_size_for(3, 2) == 2


def test_generator_holds_a_worker_whose_groups_are_slow_while_others_can_group():
    gen = generator(world=4, size=3, seed=0)

    def members(answers: list) -> list[int]:
        return sorted(w for w, _ in answers)

    # Worker 3 sits behind a slow link: its ring all-reduces take 60 ms, the others' 5 ms, so it
    # waits 55 ms in the queue before it may join; meanwhile the others group without it.
    assert ready(gen, 3, ring_s=0.060, now=0.00) == [] and ready(gen, 0, ring_s=0.005, now=0.00) == []
    assert ready(gen, 1, ring_s=0.005, now=0.01) == []
    assert members(ready(gen, 2, ring_s=0.005, now=0.02)) == [0, 1, 2]
    assert ready(gen, 0, ring_s=0.005, now=0.03) == [] and ready(gen, 1, ring_s=0.005, now=0.04) == []
    assert members(ready(gen, 2, ring_s=0.005, now=0.05)) == [0, 1, 2]
    assert ready(gen, 0, ring_s=0.005, now=0.06) == []
    assert members(ready(gen, 1, ring_s=0.005, now=0.07)) == [0, 1, 3]  # held for 55 ms, then grouped
    assert gen.cost(3) == pytest.approx(0.060) and gen.cost(0) == pytest.approx(0.005)
    # Nobody is held when the others cannot make a group without it.
    gen = generator(world=3, size=3)
    ready(gen, 0, ring_s=0.5, now=0.0), ready(gen, 1, ring_s=0.001, now=0.0)
    assert members(ready(gen, 2, ring_s=0.001, now=0.0)) == [0, 1, 2]


def test_settings_are_checked_before_any_worker_starts():
    with pytest.raises(ConfigError, match="--group-size"):
        TrainConfig.from_dict({"algorithm": "prague", "group_size": 1}).validate()
    with pytest.raises(ConfigError, match="--budget"):
        TrainConfig.from_dict({"algorithm": "adpsgd", "budget": "forever"}).validate()
    for lag in (-1, 1.5):
        with pytest.raises(ConfigError, match="--max-lag"):
            TrainConfig.from_dict({"algorithm": "adpsgd", "max_lag": lag}).validate()
    with pytest.raises(ConfigError, match="--topology"):  # an odd ring has no active/passive split
        TrainConfig.from_dict({"algorithm": "adpsgd", "workers": 3}).validate()
    TrainConfig.from_dict({"algorithm": "adpsgd", "workers": 3, "topology": "bipartite"}).validate()
    TrainConfig.from_dict({"algorithm": "prague", "resume": "auto"}).validate()  # each worker from its own file
    with pytest.warns(UserWarning, match="--group-size"):
        TrainConfig.from_dict({"algorithm": "prague", "workers": 2, "group_size": 3}).validate()


def test_generator_never_groups_a_lost_worker_and_stops_without_it():
    gen = generator(world=4, size=2, seed=0)
    assert ready(gen, 1) == []  # worker 1 waits for a group, then dies
    assert gen.drop(1) == [] and gen.lost == {1} and gen.ready == []
    assert ready(gen, 0) == []
    assert sorted(w for w, _ in ready(gen, 2)) == [0, 2]  # grouped without it
    for _, answer in ready(gen, 1):  # back after being dropped (hung, resumed): told to stop
        assert int(answer[0]) == STOP
    ready(gen, 0, done=True), ready(gen, 2, done=True)  # grouped again
    for worker in (3, 0):  # the lost one counts as done: everyone else is, so all stop
        assert [(w, int(answer[0])) for w, answer in ready(gen, worker, done=True)] == [(worker, STOP)]
    assert gen.done == [1, 1, 1, 1]


def test_a_successor_tells_a_worker_the_group_its_lost_predecessor_formed_for_it():
    """The lost generator formed groups; some members never heard of theirs. The successor hands
    a group of live members to a member that never heard of it (its partners wait in the ring),
    queues one that heard of it, and never hands out a group with a lost member."""
    import torch.distributed as dist

    from distrain.algorithms.prague import GroupBoard

    store = dist.HashStore()
    first = generator(world=4, size=2, seed=3)
    first.board = GroupBoard(store)
    ready(first, 1)
    pair = ready(first, 2)  # one group, recorded before anyone hears of it
    assert sorted(w for w, _ in pair) == [1, 2]
    gid = int(pair[0][1][2 + 2])
    ready(first, 3)
    with_lost = ready(first, 0)  # the generator's own worker is grouped with 3, then it dies
    assert sorted(w for w, _ in with_lost) == [0, 3]
    assert not GroupBoard(store).training_over()

    successor = GroupGenerator(4, 2, control=None, seed=0, rank=1, successor=True)  # type: ignore[arg-type]
    successor.board = GroupBoard(store)
    successor.inherit([0] * 4, [0] * 4, lost={0})
    answers = ready(successor, 2)  # never heard of [1, 2]: it gets it now, and is not queued
    assert [(w, a.tolist()) for w, a in answers] == [(2, pair[1][1].tolist())] and successor.ready == []
    assert ready(successor, 3) == [] and successor.ready == [3]  # its group had the lost worker
    heard = torch.tensor([0, gid] + [0] * 8)
    assert successor.on_ready(1, heard) != [] and successor.ready == []  # heard of it: grouped anew, with 3
    assert int(successor._answer(GROUP, [1, 3])[4]) >> 40 == 1  # the successor's ids are its own

    assert ready(successor, 3, done=True) == []
    assert ready(successor, 2, done=True) != [] and not GroupBoard(store).training_over()  # 1 is not done
    stop = ready(successor, 1, done=True)  # the last one: training is over, marked before the first STOP
    assert [(w, int(a[0])) for w, a in stop] == [(1, STOP)] and GroupBoard(store).training_over()


def test_a_waiter_gives_up_on_a_blocked_call_and_goes_on_with_a_new_thread():
    from distrain.algorithms.gossip import Waiter

    waiter, release = Waiter("test-wait"), threading.Event()
    stuck = waiter.start(lambda: release.wait(30) and None)
    assert not stuck.wait(0.05)
    waiter.abandon()
    done = waiter.start(lambda: None)
    assert done.wait(10)  # served by a fresh thread while the first is still blocked
    failed = waiter.start(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.wait(10)
    release.set()
    assert stuck.wait(10)  # the abandoned call still completes in its own thread
    waiter.close()


def test_asynchronous_gossip_honours_min_workers():
    from distrain.algorithms.adpsgd import ADPSGD
    from distrain.assemble import adpsgd_settings, survives

    config = TrainConfig.from_dict({"algorithm": "adpsgd", "workers": 4, "min_workers": 3})
    assert survives(config)
    assert not survives(TrainConfig.from_dict({"algorithm": "adpsgd", "workers": 4, "min_workers": 4}))
    algo = ADPSGD.__new__(ADPSGD)
    algo.settings, algo.state = adpsgd_settings(config), SharedModel(torch.zeros(2), rank=0, world=4)
    algo.state.mark_lost(3)
    algo._check_members()  # three left: go on
    algo.state.mark_lost(1)
    with pytest.raises(WorkerFailure, match=r"lost workers \[1, 3\]; 2 left, fewer than --min-workers 3"):
        algo._check_members()


def test_asynchronous_gossip_reports_each_declared_loss_once_so_the_data_is_dealt_out_again():
    """newly_lost(): a death declared in the store is reported once (the loop then deals the
    data out over the others); a peer this worker's own gossip found gone is reported at once,
    without waiting for the next look in the store; a worker that joined again and is declared
    dead a second time is reported again."""
    from datetime import timedelta

    import torch.distributed as dist

    from distrain.algorithms.adpsgd import ADPSGD
    from distrain.launch.common import free_port
    from distrain.runtime.health import DEAD_KEY, Liveness, declare_dead

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    worker = object.__new__(ADPSGD)  # the hook's state only: no engine threads, no process group
    worker.engine, worker.state = object(), SharedModel(torch.zeros(2), rank=0, world=4)
    worker._reported, worker._lost_checked, worker._dead = {}, -1.0, Liveness("127.0.0.1", port, 4)
    assert worker.newly_lost(force=True) == {}
    declare_dead(master, 2)
    [(lost, first)] = worker.newly_lost(force=True).items()
    assert lost == 2
    assert worker.newly_lost(force=True) == {}  # once
    worker.state.mark_lost(3)  # its gossip found worker 3 gone: no need to wait for the store
    assert list(worker.newly_lost()) == [3]
    assert worker.newly_lost() == {}
    master.delete_key(DEAD_KEY.format(2))  # worker 2 started again (its next life) ...
    declare_dead(master, 2)  # ... and lost again
    [(lost, second)] = worker.newly_lost(force=True).items()
    assert lost == 2 and second > first  # a new declaration, so reported again


def test_a_dead_mark_of_a_joiners_earlier_life_is_not_a_new_loss():
    """A joiner deletes its earlier life's dead mark only once it enters, after the members
    admitted it; a member that reads the mark after the admission must not drop the live joiner
    (its calls would go unanswered); a mark declared after the admission is a new loss."""
    import time

    state = SharedModel(torch.zeros(2), rank=1, world=4)
    before = time.time()
    state.mark_lost(2)
    state.revive(2, epoch=1)
    assert state.current_deaths({2: before, 3: before}) == {3: before}  # worker 3 never came back
    later = time.time() + 1
    assert state.current_deaths({2: later}) == {2: later}


def test_an_asynchronous_workers_checkpoint_counts_its_own_step_for_all_and_restores_the_clock():
    """A set of step s holds every worker at its own s-th step: the file counts s for everyone,
    not the further progress this worker had heard of (resumed from the set, those steps were
    never taken: counted, they end the global budget early, and merged by maximum they would
    raise another worker's own count). Loaded, the counts, the lag bound's reference and the
    run's clock (time budget, snapshot points) go on from there."""
    from distrain.algorithms.adpsgd import ADPSGD
    from distrain.algorithms.gossip import GOSSIP_CLOCK, GOSSIP_COUNTS

    saved = object.__new__(ADPSGD)  # the hooks' state only: no engine threads, no process group
    saved.state, saved._resumed_at = SharedModel(torch.zeros(2), rank=1, world=3), 0.0
    saved.state.counts = [9, 6, 14]  # its own 6; the others further on, as far as it heard
    state = saved.state_dict()
    assert state[GOSSIP_COUNTS] == [6, 6, 6] and state[GOSSIP_CLOCK] == 0.0

    resumed = object.__new__(ADPSGD)
    resumed.state, resumed._resumed_at = SharedModel(torch.zeros(2), rank=2, world=3), 0.0
    resumed.load_state_dict({GOSSIP_COUNTS: [12, 10, 14], GOSSIP_CLOCK: 7.5})  # a final set's exact counts
    assert resumed.state.counts == [12, 10, 14] and resumed.state.steps_at_round == 14 and resumed._resumed_at == 7.5
    resumed.resume_at(11)  # this worker took worker 0's file (it was lost before the set): its steps
    assert resumed.state.counts == [12, 10, 11] and resumed.state.global_steps() == 33
    with pytest.raises(WorkerFailure, match="steps of 2 workers; this run has 3"):
        resumed.load_state_dict({GOSSIP_COUNTS: [1, 2], GOSSIP_CLOCK: 0.0})
    resumed.snapshots = Snapshots(interval=1.0, limit=100)
    resumed.settings, resumed.engine, resumed.entered = type("S", (), {"budget": "time", "time_budget": 10.0})(), None, None
    resumed.flat = type("F", (), {"read": staticmethod(lambda out: out)})()
    resumed.read_copy = torch.zeros(2)
    resumed.start(total_steps=100, steps_per_epoch=10)
    assert resumed.elapsed() >= 7.5 and resumed.snapshots.first == 8  # the clock goes on; points after 7.5 s
    assert 0.75 <= resumed.budget.progress(11, 33, resumed.elapsed()) < 1
