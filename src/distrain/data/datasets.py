"""Data sets as in-memory tensors: built-in generators, file formats and per-worker shard files.

Every loader returns a ``(train, test)`` pair of :class:`ArrayDataset`. The two halves of a pair
always report the same ``num_classes`` so that every worker builds the same model head.
"""

from __future__ import annotations

import gzip
import logging
import os
import random
import re
import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from distrain.errors import ConfigError, DataError
from distrain.extras import require
from distrain.runtime.files import atomic_write, exclusive_lock

logger = logging.getLogger(__name__)

DATASETS: tuple[str, ...] = ("digits", "idx", "mnist1d", "npz", "shards", "synthetic", "text")
"""Names :func:`load_dataset` accepts."""

TEST_FRACTION = 0.2
"""Share of the samples held out for testing where a data set has no test split of its own."""

# Bump when the layout of the mnist1d cache file changes; old files are then ignored.
_CACHE_VERSION = 1
_LOCK_TIMEOUT_S = 600.0
_IDX_UBYTE = 0x08
_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_SHARD_NAME = re.compile(r"^shard-(\d{5})\.npz$")
_SHARD_TEST = "test.npz"

Indices = Sequence[int] | np.ndarray | torch.Tensor


class ArrayDataset(Dataset):
    """A labelled data set held in memory as one input tensor and one label tensor.

    Args:
        x: inputs, one sample per row; stored as float32.
        y: integer class labels, one per sample; stored as int64.
        num_classes: number of classes; defaults to ``max(y) + 1``. Give it explicitly when a
            split may lack the highest class.

    Example::

        >>> ds = ArrayDataset(torch.zeros(4, 3), torch.tensor([0, 1, 2, 1]))
        >>> len(ds), ds.input_shape, ds.num_classes
        (4, (3,), 3)
    """

    def __init__(
        self,
        x: torch.Tensor | np.ndarray,
        y: torch.Tensor | np.ndarray,
        num_classes: int | None = None,
    ) -> None:
        self.x = torch.as_tensor(x, dtype=torch.float32)
        self.y = torch.as_tensor(y, dtype=torch.int64)
        if self.x.ndim < 1 or self.y.ndim != 1:
            raise DataError(
                f"x must have one row per sample and y must be 1-D, got shapes "
                f"{tuple(self.x.shape)} and {tuple(self.y.shape)}"
            )
        if len(self.x) != len(self.y):
            raise DataError(f"x has {len(self.x)} samples but y has {len(self.y)}; they must match")
        if len(self.y) == 0:
            raise DataError("data set is empty; it needs at least one sample")
        if int(self.y.min()) < 0:
            raise DataError(f"labels must be non-negative integers, got {int(self.y.min())}")
        max_label = int(self.y.max())
        if num_classes is None:
            num_classes = max_label + 1
        elif num_classes <= max_label:
            raise DataError(
                f"num_classes must be > the largest label {max_label}, got {num_classes}"
            )
        self._num_classes = int(num_classes)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __repr__(self) -> str:
        return (
            f"ArrayDataset(samples={len(self)}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes})"
        )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. ``(40,)`` or ``(1, 8, 8)``."""
        return tuple(self.x.shape[1:])

    @property
    def num_classes(self) -> int:
        """Number of classes the labels are drawn from."""
        return self._num_classes

    def subset(self, indices: Indices) -> ArrayDataset:
        """Return the samples at ``indices`` as a new data set with the same ``num_classes``.

        Args:
            indices: positions of the samples to keep, in the order to keep them.
        """
        index = torch.as_tensor(np.asarray(indices), dtype=torch.int64)
        return ArrayDataset(self.x[index], self.y[index], num_classes=self.num_classes)


def load_dataset(
    name: str,
    *,
    path: str | os.PathLike[str] | None = None,
    num_samples: int = 20000,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    context: int = 128,
    tokenizer: str = "bytes",
) -> tuple[Any, Any]:
    """Load a data set by name and return its ``(train, test)`` halves.

    Args:
        name: one of :data:`DATASETS`.
        path: the ``.npz`` file (``npz``) or directory (``idx``, ``shards``) to read.
        num_samples: samples to generate for ``mnist1d`` and ``synthetic``; ignored otherwise.
        seed: seed of the generators and of the train/test split where one is made here.
        cache_dir: where ``mnist1d`` and ``text`` keep generated arrays; defaults to
            ``$DISTRAIN_CACHE`` or ``~/.cache/distrain``.
        context: tokens per window of ``text`` (:mod:`distrain.data.text`: byte-level, the
            Python standard library's sources unless ``path`` names a file or directory).
        tokenizer: the tokens of ``text``: ``bytes``, or ``bpe:N`` (a byte-level BPE of ``N``
            tokens trained on the training split; :mod:`distrain.data.tokenizer`).

    Example::

        >>> train, test = load_dataset("digits", seed=0)
        >>> train.input_shape, train.num_classes
        ((1, 8, 8), 10)
    """
    if name not in DATASETS:
        raise ConfigError(
            "--dataset", f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}"
        )
    if name in ("mnist1d", "synthetic"):
        if not _is_int(num_samples) or num_samples < 10:
            raise ConfigError("--num-samples", f"must be an integer >= 10, got {num_samples!r}")
        if name == "mnist1d":
            return _load_mnist1d(num_samples, seed, cache_dir)
        return _load_synthetic(num_samples, seed)
    if name == "digits":
        return _load_digits(seed)
    if name == "text":
        from distrain.data.text import load_text

        return load_text(path, context=context, cache_dir=cache_dir, tokenizer=tokenizer)
    if path is None:
        kind = "an .npz file" if name == "npz" else "a directory"
        raise ConfigError("--data-path", f"dataset {name!r} needs a path to {kind}")
    if name == "npz":
        return _load_npz(Path(path), seed)
    if name == "idx":
        return _load_idx(Path(path))
    return _load_shard_dir(Path(path))


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------
# Built-in data sets


def _load_mnist1d(
    num_samples: int, seed: int, cache_dir: str | os.PathLike[str] | None
) -> tuple[ArrayDataset, ArrayDataset]:
    """MNIST-1D generated locally, cached as ``.npz`` so that only the first caller pays for it."""
    directory = _default_cache_dir() if cache_dir is None else Path(cache_dir)
    cache = directory / f"mnist1d-v{_CACHE_VERSION}-n{num_samples}-s{seed}.npz"
    # Fast path without the lock: the cache is replaced atomically, so a reader sees either no
    # file or a complete one.
    arrays = _read_mnist1d_cache(cache, num_samples) if cache.exists() else None
    if arrays is None:
        # Without the package, stop before writing anything (not even the lock file).
        mnist1d_data = require("mnist1d.data", feature="--dataset mnist1d", setting="--dataset")
        directory.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(cache.with_name(cache.name + ".lock"), _LOCK_TIMEOUT_S):
            # Another process may have written it while this one waited for the lock.
            arrays = _read_mnist1d_cache(cache, num_samples) if cache.exists() else None
            if arrays is None:
                logger.info(
                    "generating mnist1d (%d samples, seed %d) into %s", num_samples, seed, cache
                )
                arrays = _generate_mnist1d(mnist1d_data, num_samples, seed)
                _atomic_savez(cache, version=np.array(_CACHE_VERSION), **arrays)
    return (
        ArrayDataset(arrays["x"], arrays["y"], num_classes=10),
        ArrayDataset(arrays["x_test"], arrays["y_test"], num_classes=10),
    )


def _default_cache_dir() -> Path:
    env = os.environ.get("DISTRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "distrain"


def _generate_mnist1d(mnist1d_data: ModuleType, num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """Arrays of a fresh MNIST-1D draw made by the ``mnist1d.data`` module given."""
    args = mnist1d_data.get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    # make_dataset reseeds the global `random` and `np.random` generators; put them back so that
    # loading data does not change the caller's random stream.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = mnist1d_data.make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return {
        "x": np.asarray(data["x"], dtype=np.float32),
        "y": np.asarray(data["y"], dtype=np.int64),
        "x_test": np.asarray(data["x_test"], dtype=np.float32),
        "y_test": np.asarray(data["y_test"], dtype=np.int64),
    }


def _read_mnist1d_cache(cache: Path, num_samples: int) -> dict[str, np.ndarray] | None:
    """Return the cached arrays, or None (with a warning) if the file is unusable."""
    total = (num_samples // 10) * 10
    num_train = int(total * 0.8)
    expected = {
        "x": (num_train, 40),
        "y": (num_train,),
        "x_test": (total - num_train, 40),
        "y_test": (total - num_train,),
    }
    try:
        arrays = _read_npz(cache)
        if int(arrays.get("version", -1)) != _CACHE_VERSION:
            raise ValueError(f"format version {arrays.get('version')}, expected {_CACHE_VERSION}")
        for key, shape in expected.items():
            if key not in arrays or arrays[key].shape != shape:
                raise ValueError(f"array {key!r} missing or not of shape {shape}")
        for key in ("y", "y_test"):
            if arrays[key].min() < 0 or arrays[key].max() > 9:
                raise ValueError(f"labels in {key!r} outside 0..9")
    except (DataError, ValueError) as err:
        logger.warning("ignoring unusable mnist1d cache %s (%s); regenerating", cache, err)
        return None
    return arrays


def _load_digits(seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's 8x8 digits, scaled to [0, 1], split 80/20 stratified by class."""
    sklearn_datasets = require("sklearn.datasets", feature="--dataset digits", setting="--dataset")
    sklearn_selection = require("sklearn.model_selection", feature="--dataset digits", setting="--dataset")
    digits = sklearn_datasets.load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    index = np.arange(len(y))
    train_idx, test_idx = sklearn_selection.train_test_split(
        index, test_size=TEST_FRACTION, stratify=y, random_state=seed
    )
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    return (
        ArrayDataset(x[train_idx], y[train_idx], num_classes=10),
        ArrayDataset(x[test_idx], y[test_idx], num_classes=10),
    )


def _load_synthetic(num_samples: int, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """Ten Gaussian blobs in 32 dimensions: nearly linearly separable (about 97% reachable)."""
    num_features, num_classes, separation = 32, 10, 0.7
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(num_classes, num_features)) * separation
    y = rng.permutation(np.arange(num_samples) % num_classes)
    x = centers[y] + rng.normal(size=(num_samples, num_features))
    num_train = int(num_samples * (1 - TEST_FRACTION))
    return (
        ArrayDataset(x[:num_train], y[:num_train], num_classes=num_classes),
        ArrayDataset(x[num_train:], y[num_train:], num_classes=num_classes),
    )


# ---------------------------------------------------------------------------------------------
# .npz files


def _load_npz(file: Path, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """An ``.npz`` with ``x`` and ``y``, and optionally ``x_test`` and ``y_test``."""
    arrays = _read_npz(file)
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(f"{file}: missing array {key!r}; the file needs arrays 'x' and 'y'")
    has_test = ("x_test" in arrays, "y_test" in arrays)
    if any(has_test) and not all(has_test):
        raise DataError(f"{file}: has only one of 'x_test' and 'y_test'; give both or neither")
    x, y = _check_xy(arrays["x"], arrays["y"], f"{file} (x, y)")
    if all(has_test):
        x_test, y_test = _check_xy(arrays["x_test"], arrays["y_test"], f"{file} (x_test, y_test)")
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(
                f"{file}: x_test samples have shape {x_test.shape[1:]} but x samples have "
                f"{x.shape[1:]}; they must match"
            )
    else:
        if len(y) < 2:
            raise DataError(f"{file}: needs at least 2 samples to split into train and test")
        train_idx, test_idx = _split_indices(len(y), seed)
        x, y, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
    num_classes = int(max(y.max(), y_test.max())) + 1
    return (
        ArrayDataset(x, y, num_classes=num_classes),
        ArrayDataset(x_test, y_test, num_classes=num_classes),
    )


def _split_indices(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/test split of ``range(n)``; both halves sorted and non-empty."""
    perm = np.random.default_rng(seed).permutation(n)
    num_test = min(n - 1, max(1, round(n * TEST_FRACTION)))
    return np.sort(perm[num_test:]), np.sort(perm[:num_test])


def _check_xy(x: np.ndarray, y: np.ndarray, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate one (inputs, labels) pair read from ``source``; return float32 and int64 copies."""
    if x.ndim < 2:
        raise DataError(f"{source}: x must have shape (samples, features...), got {x.shape}")
    if y.ndim != 1:
        raise DataError(f"{source}: y must be 1-D (one label per sample), got shape {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{source}: x has {len(x)} samples but y has {len(y)}; they must match")
    if len(y) == 0:
        raise DataError(f"{source}: is empty; it needs at least one sample")
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise DataError(f"{source}: x must be numeric, got dtype {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise DataError(f"{source}: x contains NaN or infinite values")
    if np.issubdtype(y.dtype, np.integer):
        labels = y.astype(np.int64)
    elif np.issubdtype(y.dtype, np.floating) and np.isfinite(y).all() and (y == np.round(y)).all():
        labels = y.astype(np.int64)
    else:
        raise DataError(f"{source}: labels must be non-negative integers, got dtype {y.dtype}")
    if labels.min() < 0:
        raise DataError(f"{source}: labels must be non-negative integers, got {labels.min()}")
    return x, labels


def _read_npz(file: Path) -> dict[str, np.ndarray]:
    """Read every array of an ``.npz`` file into memory.

    All data files of this module are opened here, so a test can spy on which files are read.
    """
    try:
        with np.load(file, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except FileNotFoundError:
        raise DataError(f"{file}: file not found") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise DataError(f"{file}: not a readable .npz file ({err})") from None


def _atomic_savez(file: Path, **arrays: np.ndarray) -> None:
    """Write an ``.npz`` so that readers see either the old file or the complete new one."""
    atomic_write(file, lambda out: np.savez(out, **arrays))


# ---------------------------------------------------------------------------------------------
# MNIST IDX files


def read_idx(file: str | os.PathLike[str]) -> np.ndarray:
    """Read an unsigned-byte IDX file (the MNIST format), gzipped if its name ends in ``.gz``.

    Args:
        file: path of the file.

    Raises:
        DataError: naming the file if the magic number, dimensions or size are wrong.

    Example::

        >>> images = read_idx("mnist/train-images-idx3-ubyte.gz")  # uint8, shape (60000, 28, 28)
    """
    file = Path(file)
    try:
        if file.suffix == ".gz":
            with gzip.open(file, "rb") as stream:
                data = stream.read()
        else:
            data = file.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{file}: file not found") from None
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{file}: cannot read or decompress ({err})") from None
    if len(data) < 4:
        raise DataError(f"{file}: truncated IDX file: {len(data)} bytes, shorter than the header")
    zero0, zero1, dtype_code, ndim = data[:4]
    if zero0 != 0 or zero1 != 0:
        raise DataError(f"{file}: bad IDX magic number {data[:4].hex()}; it must start with 0000")
    if dtype_code != _IDX_UBYTE:
        raise DataError(
            f"{file}: IDX data type 0x{dtype_code:02x} is not supported; only unsigned byte "
            f"(0x08) is"
        )
    if ndim < 1:
        raise DataError(f"{file}: IDX file declares 0 dimensions; it needs at least 1")
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise DataError(f"{file}: truncated IDX header: {len(data)} bytes, need {header_size}")
    dims = struct.unpack(f">{ndim}i", data[4:header_size])
    if any(d < 0 for d in dims):
        raise DataError(f"{file}: IDX dimensions must be >= 0, got {dims}")
    expected = header_size + int(np.prod(dims, dtype=np.int64))
    if len(data) != expected:
        problem = "truncated" if len(data) < expected else "has trailing bytes"
        raise DataError(
            f"{file}: IDX file {problem}: dimensions {dims} need {expected} bytes, got {len(data)}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(dims)


def _find_idx(directory: Path, base: str) -> Path:
    for candidate in (directory / base, directory / f"{base}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"{directory}: missing {base} (or {base}.gz); an idx directory needs the 4 MNIST files"
    )


def _load_idx(directory: Path) -> tuple[ArrayDataset, ArrayDataset]:
    """The four MNIST IDX files in ``directory``; images scaled to [0, 1], shaped (1, H, W)."""
    if not directory.is_dir():
        raise DataError(f"{directory}: not a directory; --data-path must name the IDX directory")
    files = {key: _find_idx(directory, base) for key, base in _IDX_FILES.items()}
    splits = []
    for split in ("train", "test"):
        images_file, labels_file = files[f"{split}_images"], files[f"{split}_labels"]
        images, labels = read_idx(images_file), read_idx(labels_file)
        if images.ndim != 3:
            raise DataError(
                f"{images_file}: images must have 3 dimensions (N, H, W), got {images.shape}"
            )
        if labels.ndim != 1:
            raise DataError(f"{labels_file}: labels must have 1 dimension (N,), got {labels.shape}")
        if len(images) != len(labels):
            raise DataError(
                f"{labels_file}: has {len(labels)} labels but {images_file.name} has "
                f"{len(images)} images; they must match"
            )
        if len(labels) == 0:
            raise DataError(f"{images_file}: is empty; it needs at least one image")
        splits.append(((images.astype(np.float32) / 255.0)[:, None], labels.astype(np.int64)))
    (x, y), (x_test, y_test) = splits
    num_classes = int(max(y.max(), y_test.max())) + 1
    return (
        ArrayDataset(x, y, num_classes=num_classes),
        ArrayDataset(x_test, y_test, num_classes=num_classes),
    )


# ---------------------------------------------------------------------------------------------
# Shard directories: shard-00000.npz, shard-00001.npz, ... and test.npz


def write_shard_dir(
    path: str | os.PathLike[str], train: ArrayDataset, test: ArrayDataset, num_shards: int
) -> list[Path]:
    """Write ``train`` as ``num_shards`` contiguous shard files plus ``test.npz`` into ``path``.

    Shard files left over from an earlier write with more shards are removed. Each file is
    written atomically and records ``num_classes``, so every worker agrees on it.

    Args:
        path: directory to write; created if missing.
        train: samples to split into shards, in order.
        test: the test set, written whole.
        num_shards: number of shard files, between 1 and ``len(train)``.

    Returns:
        The shard files written, in order.

    Example::

        >>> train, test = load_dataset("digits")
        >>> write_shard_dir("/shared/digits", train, test, num_shards=8)
        >>> mine = load_worker_shards("/shared/digits", rank=1, world_size=4)  # shards 1 and 5
    """
    if not _is_int(num_shards) or not 1 <= num_shards <= len(train):
        raise ConfigError(
            "num_shards",
            f"must be an integer from 1 to {len(train)} (the train size), got {num_shards!r}",
        )
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    num_classes = np.array(max(train.num_classes, test.num_classes))
    written = []
    for i, part in enumerate(np.array_split(np.arange(len(train)), num_shards)):
        file = directory / f"shard-{i:05d}.npz"
        _atomic_savez(
            file, x=train.x[part].numpy(), y=train.y[part].numpy(), num_classes=num_classes
        )
        written.append(file)
    for stale in _shard_files(directory)[num_shards:]:
        logger.info("removing stale shard file %s", stale)
        stale.unlink()
    _atomic_savez(
        directory / _SHARD_TEST, x=test.x.numpy(), y=test.y.numpy(), num_classes=num_classes
    )
    logger.info("wrote %d shards of %d samples in total to %s", num_shards, len(train), directory)
    return written


def worker_shard_files(path: str | os.PathLike[str], rank: int, world_size: int) -> list[Path]:
    """Return the shard files of ``path`` that worker ``rank`` owns: shard ``i`` if ``i % world_size == rank``.

    Args:
        path: a directory written by :func:`write_shard_dir`.
        rank: this worker, ``0 <= rank < world_size``.
        world_size: number of workers; at most the number of shards.
    """
    if not _is_int(world_size) or world_size < 1:
        raise ConfigError("--workers", f"must be an integer >= 1, got {world_size!r}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ConfigError("rank", f"must be an integer from 0 to {world_size - 1}, got {rank!r}")
    shards = _shard_files(Path(path))
    if len(shards) < world_size:
        raise DataError(
            f"{path}: has {len(shards)} shard files but there are {world_size} workers; "
            f"each worker needs at least one shard"
        )
    return shards[rank::world_size]


def load_worker_shards(path: str | os.PathLike[str], rank: int, world_size: int) -> ArrayDataset:
    """Load only the shard files worker ``rank`` owns (see :func:`worker_shard_files`), concatenated.

    Args:
        path: a directory written by :func:`write_shard_dir`.
        rank: this worker, ``0 <= rank < world_size``.
        world_size: number of workers; at most the number of shards.
    """
    return _concat_files(worker_shard_files(path, rank, world_size))


def load_shard_dir_test(path: str | os.PathLike[str]) -> ArrayDataset:
    """Load the ``test.npz`` of a shard directory.

    Args:
        path: a directory written by :func:`write_shard_dir`.
    """
    return _concat_files([Path(path) / _SHARD_TEST])


def _load_shard_dir(directory: Path) -> tuple[ArrayDataset, ArrayDataset]:
    """All shards of ``directory`` concatenated, and its test set."""
    shards = _shard_files(directory)
    if not shards:
        raise DataError(f"{directory}: no shard files (shard-00000.npz, ...) found")
    train, test = _concat_files(shards), load_shard_dir_test(directory)
    num_classes = max(train.num_classes, test.num_classes)
    return (
        ArrayDataset(train.x, train.y, num_classes=num_classes),
        ArrayDataset(test.x, test.y, num_classes=num_classes),
    )


def _shard_files(directory: Path) -> list[Path]:
    """The shard files of ``directory`` in order; DataError if the numbering has a gap."""
    if not directory.is_dir():
        raise DataError(
            f"{directory}: not a directory; a shard directory holds shard-NNNNN.npz files"
        )
    found = sorted(
        (int(m.group(1)), entry)
        for entry in directory.iterdir()
        if (m := _SHARD_NAME.match(entry.name))
    )
    for expected, (number, file) in enumerate(found):
        if number != expected:
            raise DataError(f"{directory}: shard-{expected:05d}.npz is missing (found {file.name})")
    return [file for _, file in found]


def _concat_files(files: list[Path]) -> ArrayDataset:
    """Read ``x``/``y`` from each file and concatenate them into one data set."""
    xs, ys, num_classes = [], [], 0
    for file in files:
        arrays = _read_npz(file)
        for key in ("x", "y"):
            if key not in arrays:
                raise DataError(f"{file}: missing array {key!r}; a shard file needs 'x' and 'y'")
        x, y = _check_xy(arrays["x"], arrays["y"], str(file))
        if xs and x.shape[1:] != xs[0].shape[1:]:
            raise DataError(
                f"{file}: samples have shape {x.shape[1:]} but {files[0].name} has "
                f"{xs[0].shape[1:]}; all shards must match"
            )
        stored = int(arrays["num_classes"]) if "num_classes" in arrays else 0
        num_classes = max(num_classes, stored, int(y.max()) + 1)
        xs.append(x)
        ys.append(y)
    return ArrayDataset(np.concatenate(xs), np.concatenate(ys), num_classes=num_classes)
