"""The run's evaluations, as both worker loops make them (distrain's and the PyTorch baselines').

During the run the model is evaluated on ``--eval-samples`` of the test set (the probe set); at
the end, and when ``--stop-at-target`` ends the run early, on all of it. The first evaluation
that meets the target (``--target-loss``, else ``--target-accuracy``) gives ``time_to_target_s``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from distrain.data.batches import eval_subset
from distrain.tasks import Task


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
