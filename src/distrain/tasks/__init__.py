"""Tasks: the one place a training loss and the evaluation metrics are defined.

A task turns a model's output and the batch's targets into per-sample losses (what the
optimizer minimises, and what adaptive compression reads), and evaluates a model on a data set.
distrain's own loop, ``distrain.fit`` and the DDP baselines know no loss of their own: they ask
the run's task.

    classification   cross-entropy over class logits; test accuracy and test loss
    regression       mean squared error over the output's values; test loss (the MSE)
    lm               next-token cross-entropy over ``[batch, context, vocab]`` logits, a sample's
                     loss the mean over its tokens; test loss in nats per token, and bits per byte
                     (``test_bpb``: per token x the test set's ``tokens_per_byte``, 1 for bytes)

Example::

    from distrain.tasks import build_task
    task = build_task("regression")
    losses = task.losses(model(x), y)          # one loss per sample
    metrics = task.evaluate(model, test_set, torch.device("cpu"))   # {"test_loss": ...}
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from distrain.data.batches import batches_of
from distrain.errors import ConfigError

#: A user's own loss: (model output, targets) -> the batch's per-sample losses, or their mean.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Task:
    """What a run learns: its per-sample loss and how a model is evaluated."""

    name = "task"
    #: True when targets are class indices (int64).
    classes = True
    #: True when each sample has one class label: the task reports a test accuracy, and label
    #: histograms and Dirichlet splits apply.
    labels = True

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The per-sample losses of a batch: a tensor of shape ``[batch]``."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, dataset: Dataset, device: torch.device,
                 batch_size: int = 1024) -> dict[str, float]:
        """``test_loss`` (the mean per-sample loss), ``test_accuracy`` (0..1) for tasks with
        labels, and what :meth:`extra_metrics` adds, of ``model`` on ``dataset`` (in eval mode;
        its mode is restored after)."""
        was_training = model.training
        model.eval()
        n = len(dataset)  # type: ignore[arg-type]
        loss_sum, correct = 0.0, 0
        try:
            for start in range(0, n, batch_size):
                x, y = batches_of(dataset, torch.arange(start, min(start + batch_size, n)), classes=self.classes)
                x, y = x.to(device), y.to(device)
                out = model(x)
                loss_sum += float(self.losses(out, y).sum())
                if self.labels:
                    correct += int((out.argmax(1) == y).sum())
        finally:
            model.train(was_training)
        metrics = {"test_loss": loss_sum / max(n, 1)}
        if self.labels:
            metrics["test_accuracy"] = correct / max(n, 1)
        return {**metrics, **self.extra_metrics(metrics["test_loss"])}

    def extra_metrics(self, test_loss: float) -> dict[str, float]:
        """Metrics derived from the test loss (e.g. bits per byte); none by default."""
        return {}

    def reached(self, metrics: dict[str, float], target_accuracy: float | None, target_loss: float | None) -> bool:
        """Whether ``metrics`` meet the run's target: the test loss at or below ``target_loss``
        when one is set, else (tasks with classes) the accuracy at or above ``target_accuracy``."""
        if target_loss is not None:
            return metrics.get("test_loss", float("inf")) <= target_loss
        if self.labels and target_accuracy is not None:
            return metrics.get("test_accuracy", 0.0) >= target_accuracy
        return False


class Classification(Task):
    """Class logits ``[batch, classes]`` against class indices: cross-entropy."""

    name = "classification"
    classes = True

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, reduction="none")


class Regression(Task):
    """Real-valued outputs against targets of the same number of values per sample: the mean
    squared error of each sample (a ``[batch]`` target matches a ``[batch, 1]`` output)."""

    name = "regression"
    classes = False
    labels = False

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = target.to(output.dtype)
        if output.dim() == target.dim() + 1 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        if output.shape != target.shape:
            raise ValueError(f"regression: the model's output {tuple(output.shape)} does not match the targets "
                             f"{tuple(target.shape)}")
        return (output - target).pow(2).reshape(len(output), -1).mean(1)


class LanguageModel(Task):
    """Next-token prediction: logits ``[batch, context, vocab]`` against the next tokens
    ``[batch, context]``; a sample's loss is the mean of its tokens' cross-entropies (nats), so
    per-sample losses (adaptive compression) keep their meaning. ``test_bpb`` is the test loss
    in bits per byte of text: bits per token times the test set's ``tokens_per_byte`` (1 for
    byte-level tokens, fewer for BPE; a data set without the attribute counts 1)."""

    name = "lm"
    classes = True
    labels = False

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction="none")
        return per_token.view(target.shape).mean(-1)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, dataset: Dataset, device: torch.device,
                 batch_size: int = 1024) -> dict[str, float]:
        metrics = super().evaluate(model, dataset, device, batch_size)
        return {**metrics, "test_bpb": bits_per_byte(metrics["test_loss"], dataset)}


def bits_per_byte(loss: float, dataset: Dataset) -> float:
    """A loss in nats per token of ``dataset`` as bits per byte of its text (``tokens_per_byte``)."""
    return loss / math.log(2) * float(getattr(dataset, "tokens_per_byte", 1.0))


class UserLoss(Task):
    """A task around the user's own loss function (``distrain.fit(..., loss_fn=...)``); it reports
    the test loss, and the accuracy too when ``classes``."""

    def __init__(self, loss_fn: LossFn, like: Task) -> None:
        self.loss_fn, self.classes, self.labels = loss_fn, like.classes, like.labels
        self.name = f"user:{getattr(loss_fn, '__qualname__', type(loss_fn).__qualname__)}"

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = self.loss_fn(output, target)
        if value.dim() == 0:  # a mean over the batch: every sample counts it
            return value.expand(len(output))
        if value.shape[0] != len(output):
            raise ValueError(f"loss_fn returned shape {tuple(value.shape)}; return the batch's mean, or one loss per "
                             f"sample ({len(output)})")
        return value.reshape(len(output), -1).mean(1)


TASKS: dict[str, type[Task]] = {"classification": Classification, "regression": Regression, "lm": LanguageModel}


def build_task(name: str, loss_fn: LossFn | None = None) -> Task:
    """The task called ``name``; with ``loss_fn``, the user's loss in its place (accuracy is still
    reported for ``classification``)."""
    if name not in TASKS:
        raise ConfigError("task", f"must be one of {', '.join(TASKS)}, got {name!r}")
    if loss_fn is not None:
        return UserLoss(loss_fn, TASKS[name]())
    return TASKS[name]()


def check_task_data(task: str, train_set: Dataset | None) -> None:
    """The built-in data sets hold classes: regression needs the user's own data set."""
    if task == "regression" and train_set is None:
        raise ConfigError("--task", "regression trains on your own data set (distrain.fit(model_fn, train_set, "
                                    "test_set, task='regression')); the built-in data sets are classification")


__all__ = ["TASKS", "bits_per_byte", "Classification", "LanguageModel", "LossFn", "Regression", "Task", "UserLoss", "build_task", "check_task_data"]
