"""The run's evaluations, as both worker loops make them (distrain's and the PyTorch baselines').

During the run the model is evaluated on ``--eval-samples`` of the test set (the probe set); at
the end, and when ``--stop-at-target`` ends the run early, on all of it. The first evaluation
that meets the target (``--target-loss``, else ``--target-accuracy``) gives ``time_to_target_s``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from distrain.data.batches import eval_subset
from distrain.runtime.membership import PREFIX
from distrain.tasks import Task

#: The microseconds the evaluations during training took, added up by whichever worker made each
#: (a counter in the launcher's store; see :class:`EvalTime`).
EVAL_US_KEY = PREFIX + "/eval-us"


class Evaluations:
    """What the run's evaluations found so far: the last accuracy and test loss, and when the
    target was first met (None: not yet).

    Args:
        task: how the model is scored.
        test_set: the whole test set; ``eval_samples`` of it (0: all) are the probe set.
        target_accuracy, target_loss: the run's target (see :meth:`Task.reached`).
    """

    def __init__(self, task: Task, test_set: Dataset, eval_samples: int, target_accuracy: float | None,
                 target_loss: float | None, device: torch.device) -> None:
        self.task, self.test_set, self.device = task, test_set, device
        self.probe_set = eval_subset(test_set, eval_samples)
        self.target_accuracy, self.target_loss = target_accuracy, target_loss
        self.accuracy: float | None = float("nan") if task.labels else None
        self.test_loss = float("nan")
        self.time_to_target: float | None = None

    def measure(self, model: torch.nn.Module, record: dict[str, Any], final: bool) -> dict[str, float]:
        """Evaluate ``model`` (on the whole test set when ``final``, else the probe set) into
        ``record`` at ``record["time"]``; returns the figures."""
        measured = self.task.evaluate(model, self.test_set if final else self.probe_set, self.device)
        record.update(measured)
        self.accuracy, self.test_loss = measured.get("test_accuracy"), measured["test_loss"]
        if self.time_to_target is None and self.reached(measured):
            self.time_to_target = record["time"]
        return measured

    def snapshot(self, model: torch.nn.Module, when: float) -> dict[str, float]:
        """Evaluate a consensus ``model`` of ``when`` seconds into the run, taken during it and
        evaluated after it (asynchronous algorithms), on the probe set; the earliest crossing of
        the target counts, whenever it was evaluated. Returns the figures."""
        measured = self.task.evaluate(model, self.probe_set, self.device)
        if self.reached(measured) and (self.time_to_target is None or when < self.time_to_target):
            self.time_to_target = when
        return measured

    def reached(self, measured: dict[str, float]) -> bool:
        """Whether ``measured`` meets the run's target."""
        return self.task.reached(measured, self.target_accuracy, self.target_loss)

    def stopped_at_target(self, model: torch.nn.Module, record: dict[str, Any]) -> None:
        """The run ends at the evaluation that met the target: its final figures are on the whole
        test set (measured again unless the probe set is all of it)."""
        if self.probe_set is not self.test_set:
            self.measure(model, record, final=True)


class EvalTime:
    """The seconds of the run's evaluations on this worker's clock, which its training time leaves out.

    In a synchronous run one worker evaluates and the others wait for it at their next exchange,
    so every worker's clock counts the evaluation. Without a change of members the first worker
    both evaluates and writes the summary, and its own evaluation seconds are the run's. In an
    elastic run the summary's writer is a worker that trained from the start, which is not the
    evaluator once the first worker was lost: its own evaluation seconds left its waits for the
    evaluator in the run's time (a DiLoCo
    run whose first worker was killed reported up to two thirds more training time than it
    trained). There the evaluator adds each evaluation during training to a counter in the
    launcher's store, and a worker's evaluation time is the larger of its own and what the counter
    grew by since it started (a worker that joined counts only the evaluations since). The
    evaluation after the last step is each worker's own: nobody waits for it.

    The counter is read at each evaluation and when the run's time is taken for a checkpoint or
    the summary; between those a non-evaluator's ``time`` may still hold the evaluator's last
    evaluation, which is read at the next one.

    Args:
        store: the launcher's store (None: not an elastic run, each worker's own seconds count).
        synchronous: whether the others wait for the evaluator (asynchronous algorithms evaluate
            only after training).
    """

    def __init__(self, store: dist.Store | None, synchronous: bool) -> None:
        self.store = store if synchronous else None
        self.own = 0.0  # this worker's evaluations during training
        self.final = 0.0  # and after its last step
        self.counted = 0.0  # the counter's growth since this worker started, as last read
        self.start = self._counter()

    def _counter(self) -> float:
        return int(self.store.add(EVAL_US_KEY, 0)) / 1e6 if self.store is not None else 0.0

    def add(self, seconds: float, *, during: bool, measured: bool) -> None:
        """An evaluation of ``seconds`` on this worker, ``during`` training (else after its last
        step); ``measured``: this worker was the evaluator, whose evaluation the others wait for."""
        if not during:
            self.final += seconds
            return
        self.own += seconds
        if self.store is not None and measured:
            self.store.add(EVAL_US_KEY, round(seconds * 1e6))
        self.seconds(refresh=True)

    def seconds(self, refresh: bool = False) -> float:
        """The evaluation seconds to leave out of this worker's training time (``refresh``: read
        the counter again first)."""
        if refresh and self.store is not None:
            self.counted = self._counter() - self.start
        return max(self.own, self.counted) + self.final
