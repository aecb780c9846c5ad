"""Which samples each worker trains on, across the changes of an elastic run's members."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distrain.data.partition import partition_indices
from distrain.data.sampler import DataPlan, ShardSampler

N, BATCH, SEED = 120, 5, 7


def parts_over(n: int) -> list[np.ndarray]:
    return partition_indices(np.zeros(N, dtype=np.int64), n, "iid", seed=SEED)


def taken(sampler: ShardSampler, first: int, last: int) -> list[int]:
    """The indices of steps [first, last)."""
    return [i for step in range(first, last) for i in sampler.batch(step).tolist()]


def test_a_run_without_changes_takes_the_samples_it_always_took():
    plan = DataPlan.first(parts_over(4), BATCH, SEED)
    for r, part in enumerate(parts_over(4)):
        alone = ShardSampler(part, BATCH, SEED, r)
        assert taken(plan.samplers[r], 0, 20) == taken(alone, 0, 20)
    # each epoch (6 steps of 4 workers) is every sample once
    assert sorted(i for r in range(4) for i in taken(plan.samplers[r], 6, 12)) == list(range(N))


@pytest.mark.parametrize("kept", [3, 1])
def test_after_a_loss_the_epoch_under_way_still_sees_every_sample_once(kept: int):
    """Worker 2 is lost at step 3 (the model holds ``kept`` of its steps: 1 as for a DiLoCo round
    that never synced): the three survivors take what was left of the epoch, theirs and its."""
    plan = DataPlan.first(parts_over(4), BATCH, SEED)
    seen = [i for r in (0, 1, 3) for i in taken(plan.samplers[r], 0, 3)] + taken(plan.samplers[2], 0, kept)
    after = plan.changed([0, 1, 3], step=3, kept={2: kept}, parts=parts_over(3))
    assert after.members == [0, 1, 3] and after.segment == 1
    carries = [len(after.samplers[m].carry) for m in (0, 1, 3)]
    assert max(carries) - min(carries) <= 1  # dealt out evenly: the epoch ends together
    for m in (0, 1, 3):
        seen += after.samplers[m].carry.tolist()
        # the carry is what the steps from 3 on take first
        s = after.samplers[m]
        assert taken(s, 3, 100)[: len(s.carry)] == s.carry.tolist()
    assert sorted(seen) == list(range(N))
    # then every sample again, over the shards of the training set split in three
    for i, m in enumerate((0, 1, 3)):
        s = after.samplers[m]
        following = taken(s, 3, 100)[len(s.carry) : len(s.carry) + len(parts_over(3)[i])]
        assert sorted(following) == sorted(parts_over(3)[i].tolist())
    # the check can fail: as many samples from the split redone at once (no carry) repeat some
    # of the epoch's and leave others out
    at_once = plan.changed([0, 1, 3], step=3, kept={2: kept}, parts=parts_over(3), carry=False)
    instead = [i for m, c in zip((0, 1, 3), carries, strict=True) for i in taken(at_once.samplers[m], 3, 100)[:c]]
    assert sorted(seen[: -sum(carries)] + instead) != list(range(N))


def test_a_worker_that_joins_starts_on_its_new_shard_and_the_members_keep_their_epoch():
    plan = DataPlan.first(parts_over(4), BATCH, SEED).changed([0, 1, 3], 3, {2: 3}, parts_over(3))
    back = plan.changed([0, 1, 3, 2], step=8, kept={}, parts=parts_over(4))
    assert len(back.samplers[2].carry) == 0 and back.samplers[2].start == 8
    assert taken(back.samplers[2], 8, 14) == taken(ShardSampler(parts_over(4)[3], BATCH, SEED, 2, segment=2), 0, 6)
    for m in (0, 1, 3):
        assert back.samplers[m].carry.tolist() == plan.samplers[m].pending(8).tolist()


def test_the_plan_travels_as_one_tensor():
    plan = DataPlan.first(parts_over(4), BATCH, SEED).changed([3, 0, 1], 3, {2: 2}, parts_over(3))
    state = plan.state()
    assert state.dtype == torch.int64
    again = DataPlan.from_state(state.clone(), parts_over, BATCH, SEED)
    assert again.members == [3, 0, 1] and again.segment == 1
    for m in again.members:
        assert taken(again.samplers[m], 3, 40) == taken(plan.samplers[m], 3, 40)
    with pytest.raises(ValueError, match="does not add up"):
        DataPlan.from_state(state[:-1], parts_over, BATCH, SEED)


def test_a_sampler_refuses_a_step_before_its_start():
    s = ShardSampler(np.arange(10), 2, 0, 0, carry=torch.arange(3), start=4)
    with pytest.raises(ValueError, match="start at step 4"):
        s.batch(3)
    assert s.batch(4).tolist() == [0, 1] and s.pending(5).tolist() == [2]
