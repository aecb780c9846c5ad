"""Split sample indices among workers: equal iid parts, or label-skewed Dirichlet parts."""

from __future__ import annotations

import logging
import math
import numbers

import numpy as np
import torch
from torch.utils.data import Dataset

from distrain.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

PARTITION_SCHEMES: tuple[str, ...] = ("dirichlet", "iid")
"""Names :func:`partition_indices` accepts as ``scheme``."""


def partition_indices(
    labels: np.ndarray | torch.Tensor,
    world_size: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
) -> list[np.ndarray]:
    """Split ``range(len(labels))`` into one disjoint, sorted index array per worker.

    ``iid`` cuts a seeded permutation into ``world_size`` equal parts and drops the remainder,
    so every worker has the same number of samples. ``dirichlet`` gives each worker, for every
    class, a share drawn from Dirichlet(``alpha``): small ``alpha`` (0.1) leaves each worker
    with a few dominant classes, large ``alpha`` (100) approaches iid. It uses every sample;
    part sizes differ. A worker left empty by the draw gets one sample from the largest part.

    Args:
        labels: integer class label of each sample.
        world_size: number of workers, between 1 and the number of samples.
        scheme: one of :data:`PARTITION_SCHEMES`.
        alpha: Dirichlet concentration, finite and > 0.
        seed: the same seed gives the same parts.

    Example::

        >>> labels = np.repeat(np.arange(10), 100)
        >>> parts = partition_indices(labels, world_size=4, scheme="dirichlet", alpha=0.1)
        >>> my_train = train.subset(parts[rank])
    """
    labels = _as_labels(labels)
    if scheme not in PARTITION_SCHEMES:
        raise ConfigError(
            "--partition",
            f"unknown scheme {scheme!r}; choose one of: {', '.join(PARTITION_SCHEMES)}",
        )
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, numbers.Real)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise ConfigError("--dirichlet-alpha", f"must be a finite number > 0, got {alpha!r}")
    n = len(labels)
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, (int, np.integer))
        or not 1 <= world_size <= n
    ):
        raise ConfigError(
            "--workers",
            f"must be an integer from 1 to the number of samples ({n}), got {world_size!r}",
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        size = n // world_size
        perm = rng.permutation(n)
        return [np.sort(perm[r * size : (r + 1) * size]) for r in range(world_size)]
    return _dirichlet_parts(labels, int(world_size), float(alpha), rng)


def _dirichlet_parts(
    labels: np.ndarray, world_size: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    buckets: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(np.full(world_size, alpha))
        cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
        for rank, chunk in enumerate(np.split(members, cuts)):
            buckets[rank].append(chunk)
    parts = [np.concatenate(chunks) for chunks in buckets]
    # Repair instead of redrawing, so the result stays a deterministic function of the seed and
    # the loop always ends: len(labels) >= world_size guarantees a donor with 2+ samples.
    for rank in range(world_size):
        if len(parts[rank]) == 0:
            donor = max(range(world_size), key=lambda r: len(parts[r]))
            parts[rank], parts[donor] = parts[donor][-1:], parts[donor][:-1]
            logger.debug(
                "dirichlet partition left worker %d empty; moved one sample from %d", rank, donor
            )
    return [np.sort(part) for part in parts]


def shard_stats(
    labels: np.ndarray | torch.Tensor, parts: list[np.ndarray], num_classes: int
) -> list[dict[str, object]]:
    """Describe each worker's part: its size and how many samples of each class it holds.

    Args:
        labels: integer class label of each sample.
        parts: index arrays, one per worker, as from :func:`partition_indices`.
        num_classes: length of each histogram; every label must be below it.

    Returns:
        One JSON-serialisable dict per worker:
        ``{"rank": r, "size": n, "label_histogram": [count of class 0, count of class 1, ...]}``.

    Example::

        >>> shard_stats(np.array([0, 1, 1, 2]), [np.array([0, 1]), np.array([2, 3])], 3)
        [{'rank': 0, 'size': 2, 'label_histogram': [1, 1, 0]}, {'rank': 1, 'size': 2, 'label_histogram': [0, 1, 1]}]
    """
    labels = _as_labels(labels)
    if len(labels) and labels.max() >= num_classes:
        raise DataError(f"label {int(labels.max())} is not below num_classes={num_classes}")
    stats = []
    for rank, part in enumerate(parts):
        histogram = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
        stats.append(
            {"rank": rank, "size": len(part), "label_histogram": [int(c) for c in histogram]}
        )
    return stats


def _as_labels(labels: np.ndarray | torch.Tensor) -> np.ndarray:
    """Labels as a 1-D int64 numpy array; DataError if they are not non-negative integers."""
    array = (
        labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    )
    if array.ndim != 1:
        raise DataError(f"labels must be 1-D (one per sample), got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise DataError(f"labels must be integers, got dtype {array.dtype}")
    if array.size and array.min() < 0:
        raise DataError(f"labels must be non-negative, got {int(array.min())}")
    return array.astype(np.int64, copy=False)


def labels_of(dataset: Dataset) -> np.ndarray:
    """The class of every sample of a data set of ``(input, label)`` pairs, as an int array
    (in-memory data sets give their label tensor without reading each sample)."""
    from distrain.data.datasets import ArrayDataset

    if isinstance(dataset, ArrayDataset):
        return dataset.y.numpy()
    return np.array([int(dataset[i][1]) for i in range(len(dataset))])  # type: ignore[arg-type]
