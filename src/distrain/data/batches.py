"""Batches as tensors, from any data set of ``(input, target)`` pairs."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset

from distrain.data.datasets import ArrayDataset


def batches_of(dataset: Dataset, indices: torch.Tensor, *, classes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples at ``indices`` as ``(inputs, targets)`` tensors; targets as class indices
    (int64) when ``classes``, else as they are (regression targets). A data set with a
    ``batch(indices)`` method gathers its own."""
    if isinstance(dataset, ArrayDataset):
        x, y = dataset.x[indices], dataset.y[indices]
    elif callable(getattr(dataset, "batch", None)):  # a data set that gathers its own batches (text windows)
        x, y = dataset.batch(indices)
    elif isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        x, y = dataset.tensors[0][indices], dataset.tensors[1][indices]
    else:
        items = [dataset[int(i)] for i in indices]
        x = torch.stack([torch.as_tensor(sample) for sample, _ in items])
        y = torch.stack([torch.as_tensor(target) for _, target in items])
    return x, (y.long() if classes else y)


class EvenSubset(Dataset):
    """``n`` samples of ``dataset`` spread evenly over it (the same ones every time): what
    ``--eval-samples`` evaluates during a run."""

    def __init__(self, dataset: Dataset, n: int) -> None:
        total = len(dataset)  # type: ignore[arg-type]
        self.dataset = dataset
        self.indices = torch.arange(min(n, total), dtype=torch.int64) * total // max(min(n, total), 1)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):  # noqa: ANN204 - whatever the data set's samples are
        return self.dataset[int(self.indices[i])]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return batches_of(self.dataset, self.indices[indices], classes=False)


def eval_subset(dataset: Dataset, n: int) -> Dataset:
    """The data set evaluated during a run: ``n`` samples evenly spread over ``dataset``, or all
    of it (``n`` 0 or at least its size)."""
    return EvenSubset(dataset, n) if 0 < n < len(dataset) else dataset  # type: ignore[arg-type]
