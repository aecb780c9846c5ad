"""The evaluation seconds each worker leaves out of its training time (distrain.train.evaluation)."""

from __future__ import annotations

import torch.distributed as dist

from distrain.train.evaluation import EvalTime


def test_a_non_evaluator_leaves_out_the_evaluations_it_waited_for() -> None:
    store = dist.HashStore()
    evaluator, other = EvalTime(store, synchronous=True), EvalTime(store, synchronous=True)
    for seconds in (0.5, 0.25):  # the evaluator measures; the other only takes part briefly
        evaluator.add(seconds, during=True, measured=True)
        other.add(0.01, during=True, measured=False)
    other.add(0.02, during=False, measured=False)  # after the last step: its own
    assert evaluator.seconds(refresh=True) == 0.75
    assert other.seconds() == 0.75 + 0.02  # the counter, not its own 0.02 during training


def test_a_worker_that_joined_counts_only_the_evaluations_since() -> None:
    store = dist.HashStore()
    evaluator = EvalTime(store, synchronous=True)
    evaluator.add(2.0, during=True, measured=True)
    joined = EvalTime(store, synchronous=True)
    evaluator.add(0.5, during=True, measured=True)
    assert joined.seconds(refresh=True) == 0.5
    assert evaluator.seconds() == 2.5


def test_without_a_store_or_for_an_asynchronous_run_each_worker_counts_its_own() -> None:
    store = dist.HashStore()
    for times in ((EvalTime(None, True), EvalTime(None, True)), (EvalTime(store, False), EvalTime(store, False))):
        first, second = times
        first.add(1.0, during=True, measured=True)
        second.add(0.1, during=True, measured=False)
        assert (first.seconds(refresh=True), second.seconds(refresh=True)) == (1.0, 0.1)
