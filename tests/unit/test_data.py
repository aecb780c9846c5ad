"""Tests for distrain.data: loaders, the mnist1d cache, IDX parsing, shard directories, partitions."""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing as mp
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import distrain.data.datasets as datasets_module
from distrain.data import (
    DATASETS,
    ArrayDataset,
    load_dataset,
    load_shard_dir_test,
    load_worker_shards,
    partition_indices,
    read_idx,
    shard_stats,
    worker_shard_files,
    write_shard_dir,
)
from distrain.errors import ConfigError, DataError

# ---------------------------------------------------------------------------------------------
# ArrayDataset


def test_array_dataset_basics() -> None:
    x = torch.arange(24, dtype=torch.float64).reshape(6, 2, 2)
    y = np.array([0, 2, 1, 2, 0, 1])
    ds = ArrayDataset(x, y)
    assert len(ds) == 6
    assert ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
    assert ds.input_shape == (2, 2)
    assert ds.num_classes == 3
    xi, yi = ds[3]
    assert torch.equal(xi, x[3].float()) and int(yi) == 2

    sub = ds.subset([4, 1])
    assert torch.equal(sub.x, ds.x[[4, 1]]) and sub.y.tolist() == [0, 2]
    assert ArrayDataset(x, y, num_classes=10).subset(np.array([0])).num_classes == 10


@pytest.mark.parametrize(
    ("x", "y", "kwargs", "match"),
    [
        (torch.zeros(3, 2), torch.zeros(4, dtype=torch.int64), {}, "3 samples but y has 4"),
        (torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64), {}, "empty"),
        (torch.zeros(2, 2), torch.tensor([0, -1]), {}, "non-negative"),
        (torch.zeros(2, 2), torch.tensor([0, 5]), {"num_classes": 5}, "largest label 5"),
    ],
)
def test_array_dataset_rejects_bad_input(x, y, kwargs, match) -> None:
    with pytest.raises(DataError, match=match):
        ArrayDataset(x, y, **kwargs)


# ---------------------------------------------------------------------------------------------
# load_dataset: names and settings


def test_unknown_dataset_lists_valid_names() -> None:
    assert DATASETS == ("digits", "idx", "mnist1d", "npz", "shards", "synthetic", "text")
    with pytest.raises(ConfigError) as info:
        load_dataset("foo")
    assert info.value.setting == "--dataset"
    assert str(info.value) == (
        "--dataset: unknown dataset 'foo'; choose one of: digits, idx, mnist1d, npz, shards, synthetic, text"
    )


@pytest.mark.parametrize("name", ["npz", "idx", "shards"])
def test_file_datasets_need_a_path(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_dataset(name)
    assert info.value.setting == "--data-path"


def test_num_samples_must_be_at_least_ten() -> None:
    with pytest.raises(ConfigError) as info:
        load_dataset("synthetic", num_samples=5)
    assert info.value.setting == "--num-samples"


# ---------------------------------------------------------------------------------------------
# mnist1d and its cache


def _digest(*datasets: ArrayDataset) -> str:
    h = hashlib.sha256()
    for ds in datasets:
        h.update(ds.x.numpy().tobytes())
        h.update(ds.y.numpy().tobytes())
    return h.hexdigest()


def test_mnist1d_shapes_and_cache_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    np.random.seed(123)
    random.seed(123)
    np_before, py_before = np.random.get_state()[1].copy(), random.getstate()

    train, test = load_dataset("mnist1d", num_samples=1000, seed=3, cache_dir=tmp_path)
    assert (len(train), len(test)) == (800, 200)
    assert train.input_shape == (40,) and test.input_shape == (40,)
    assert train.num_classes == test.num_classes == 10
    assert sorted(set(train.y.tolist())) == list(range(10))
    assert torch.isfinite(train.x).all()
    # Generating must not disturb the caller's global random streams.
    assert np.array_equal(np.random.get_state()[1], np_before) and random.getstate() == py_before
    assert [p.name for p in tmp_path.glob("*.npz")] == ["mnist1d-v1-n1000-s3.npz"]

    import mnist1d.data

    def must_not_generate(*args, **kwargs):
        raise AssertionError("cache miss: make_dataset was called again")

    monkeypatch.setattr(mnist1d.data, "make_dataset", must_not_generate)
    again = load_dataset("mnist1d", num_samples=1000, seed=3, cache_dir=tmp_path)
    assert _digest(*again) == _digest(train, test)


def test_mnist1d_seed_changes_data_and_env_sets_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISTRAIN_CACHE", str(tmp_path / "env-cache"))
    a = load_dataset("mnist1d", num_samples=500, seed=0)
    b = load_dataset("mnist1d", num_samples=500, seed=1)
    assert _digest(*a) != _digest(*b)
    assert len(list((tmp_path / "env-cache").glob("*.npz"))) == 2


def test_mnist1d_corrupted_cache_is_regenerated(tmp_path: Path) -> None:
    reference = load_dataset("mnist1d", num_samples=500, seed=0, cache_dir=tmp_path / "ref")
    cache_dir = tmp_path / "cache"
    load_dataset("mnist1d", num_samples=500, seed=0, cache_dir=cache_dir)
    (cache_file,) = cache_dir.glob("*.npz")
    cache_file.write_bytes(cache_file.read_bytes()[:100])  # truncated zip

    again = load_dataset("mnist1d", num_samples=500, seed=0, cache_dir=cache_dir)
    assert _digest(*again) == _digest(*reference)
    np.load(cache_file)  # the cache file is whole again


def _load_mnist1d_in_child(cache_dir: str, barrier, queue) -> None:
    """Child process: wait for the sibling, load mnist1d, report (digest, generations)."""
    import mnist1d.data

    calls = []
    original = mnist1d.data.make_dataset

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    mnist1d.data.make_dataset = counting
    barrier.wait(timeout=60)
    train, test = load_dataset("mnist1d", num_samples=1000, seed=0, cache_dir=cache_dir)
    queue.put((_digest(train, test), len(calls)))


def test_mnist1d_concurrent_processes_generate_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_load_mnist1d_in_child, args=(str(tmp_path), barrier, queue))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert [p.exitcode for p in procs] == [0, 0]
    digests, generations = zip(*results, strict=True)
    assert sum(generations) == 1
    here = load_dataset("mnist1d", num_samples=1000, seed=0, cache_dir=tmp_path)
    assert set(digests) == {_digest(*here)}
    assert [p.name for p in tmp_path.glob("*.npz")] == ["mnist1d-v1-n1000-s0.npz"]
    assert not list(tmp_path.glob("*.tmp"))


# ---------------------------------------------------------------------------------------------
# digits and synthetic


def test_digits_shape_range_and_stratified_split() -> None:
    train, test = load_dataset("digits", seed=0)
    assert len(train) + len(test) == 1797
    assert len(test) == 360
    assert train.input_shape == (1, 8, 8) and test.input_shape == (1, 8, 8)
    assert train.num_classes == 10
    assert float(train.x.min()) == 0.0 and float(train.x.max()) == 1.0
    train_counts = np.bincount(train.y.numpy(), minlength=10)
    test_counts = np.bincount(test.y.numpy(), minlength=10)
    share = test_counts / (train_counts + test_counts)
    assert np.all(np.abs(share - 0.2) < 0.02)

    same = load_dataset("digits", seed=0)
    other = load_dataset("digits", seed=1)
    assert _digest(*same) == _digest(train, test)
    assert _digest(*other) != _digest(train, test)


def test_synthetic_shapes_determinism_and_separability() -> None:
    train, test = load_dataset("synthetic", num_samples=2000, seed=4)
    assert (len(train), len(test)) == (1600, 400)
    assert train.input_shape == (32,) and train.num_classes == 10
    assert _digest(*load_dataset("synthetic", num_samples=2000, seed=4)) == _digest(train, test)
    assert _digest(*load_dataset("synthetic", num_samples=2000, seed=5)) != _digest(train, test)
    # A nearest-class-mean classifier (a linear rule) already separates the classes well.
    means = torch.stack([train.x[train.y == c].mean(0) for c in range(10)])
    predicted = torch.cdist(test.x, means).argmin(1)
    assert (predicted == test.y).float().mean() > 0.9


# ---------------------------------------------------------------------------------------------
# .npz files


def test_npz_with_test_arrays_round_trips(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.normal(size=(30, 3, 4)),
        "y": rng.integers(0, 4, 30),
        "x_test": rng.normal(size=(7, 3, 4)),
        "y_test": np.array([0, 1, 2, 3, 4, 0, 1]),
    }
    file = tmp_path / "data.npz"
    np.savez(file, **arrays)
    train, test = load_dataset("npz", path=str(file))
    np.testing.assert_allclose(train.x.numpy(), arrays["x"].astype(np.float32))
    assert train.y.tolist() == arrays["y"].tolist()
    np.testing.assert_allclose(test.x.numpy(), arrays["x_test"].astype(np.float32))
    assert test.y.tolist() == arrays["y_test"].tolist()
    assert train.num_classes == test.num_classes == 5  # the test split holds the largest label


def test_npz_without_test_arrays_is_split_by_seed(tmp_path: Path) -> None:
    x = np.arange(50, dtype=np.float32).reshape(25, 2)
    y = np.arange(25) % 3
    file = tmp_path / "data.npz"
    np.savez(file, x=x, y=y)
    train, test = load_dataset("npz", path=file, seed=7)
    assert (len(train), len(test)) == (20, 5)
    rows = sorted(train.x[:, 0].tolist() + test.x[:, 0].tolist())
    assert rows == x[:, 0].tolist()  # disjoint and complete
    for ds in (train, test):
        assert ds.y.tolist() == [int(r) // 2 % 3 for r in ds.x[:, 0].tolist()]  # pairs stay aligned
    again = load_dataset("npz", path=file, seed=7)
    other = load_dataset("npz", path=file, seed=8)
    assert _digest(*again) == _digest(train, test)
    assert _digest(*other) != _digest(train, test)


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"x": np.zeros((4, 2))}, "missing array 'y'"),
        ({"y": np.zeros(4, dtype=np.int64)}, "missing array 'x'"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(3, dtype=np.int64)}, "4 samples but y has 3"),
        ({"x": np.zeros((0, 2)), "y": np.zeros(0, dtype=np.int64)}, "empty"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1, -1, 0])}, "non-negative integers"),
        ({"x": np.zeros((4, 2)), "y": np.array([0.5, 1, 1, 0])}, "non-negative integers"),
        (
            {"x": np.zeros((4, 2)), "y": np.zeros(4, dtype=np.int64), "x_test": np.zeros((1, 2))},
            "only one of",
        ),
    ],
)
def test_npz_errors_name_the_file(tmp_path: Path, arrays, match: str) -> None:
    file = tmp_path / "bad-data.npz"
    np.savez(file, **arrays)
    with pytest.raises(DataError, match=match) as info:
        load_dataset("npz", path=file)
    assert str(file) in str(info.value)


def test_npz_unreadable_file_names_the_file(tmp_path: Path) -> None:
    file = tmp_path / "garbage.npz"
    file.write_bytes(b"not a zip archive at all")
    with pytest.raises(DataError, match="not a readable .npz") as info:
        load_dataset("npz", path=file)
    assert str(file) in str(info.value)
    with pytest.raises(DataError, match="file not found"):
        load_dataset("npz", path=tmp_path / "absent.npz")


# ---------------------------------------------------------------------------------------------
# MNIST IDX files


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_idx_dir(directory: Path, gz: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (12, 5, 4), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 12, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (6, 5, 4), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 6, dtype=np.uint8),
    }
    arrays["train-images-idx3-ubyte"][0, 0, 0] = 255
    arrays["train-labels-idx1-ubyte"][0] = 9
    directory.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        data = _idx_bytes(array)
        if gz:
            (directory / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    arrays = _write_idx_dir(tmp_path, gz)
    train, test = load_dataset("idx", path=str(tmp_path))
    assert (len(train), len(test)) == (12, 6)
    assert train.input_shape == (1, 5, 4) and test.input_shape == (1, 5, 4)
    assert train.num_classes == test.num_classes == 10
    expected = arrays["train-images-idx3-ubyte"].astype(np.float32)[:, None] / 255.0
    np.testing.assert_allclose(train.x.numpy(), expected, rtol=0, atol=1e-7)
    assert float(train.x.max()) == 1.0
    assert train.y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert test.y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda data: data[:-3], "truncated"),
        (lambda data: data + b"\x00", "trailing bytes"),
        (lambda data: b"\x01" + data[1:], "bad IDX magic"),
        (lambda data: data[:2] + b"\x0d" + data[3:], "data type 0x0d"),
        (lambda data: data[:6], "truncated IDX header"),
    ],
)
def test_idx_damaged_file_raises_naming_it(tmp_path: Path, gz: bool, damage, match: str) -> None:
    _write_idx_dir(tmp_path, gz=False)
    name = "t10k-images-idx3-ubyte"
    damaged = damage((tmp_path / name).read_bytes())
    if gz:
        (tmp_path / name).unlink()
        name += ".gz"
        damaged = gzip.compress(damaged)
    (tmp_path / name).write_bytes(damaged)
    with pytest.raises(DataError, match=match) as info:
        load_dataset("idx", path=tmp_path)
    assert str(tmp_path / name) in str(info.value)


def test_idx_missing_or_mismatched_files(tmp_path: Path) -> None:
    _write_idx_dir(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="missing t10k-labels-idx1-ubyte"):
        load_dataset("idx", path=tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros(5, dtype=np.uint8)))
    with pytest.raises(DataError, match="has 5 labels but t10k-images-idx3-ubyte.gz has 6"):
        load_dataset("idx", path=tmp_path)
    bad_gzip = tmp_path / "broken.gz"
    bad_gzip.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DataError, match="broken.gz"):
        read_idx(bad_gzip)


# ---------------------------------------------------------------------------------------------
# Shard directories


def _small_split(n_train: int = 23, n_test: int = 5) -> tuple[ArrayDataset, ArrayDataset]:
    x = torch.arange((n_train + n_test) * 3, dtype=torch.float32).reshape(-1, 3)
    y = torch.arange(n_train + n_test) % 4
    return ArrayDataset(x[:n_train], y[:n_train]), ArrayDataset(x[n_train:], y[n_train:])


def test_shard_dir_worker_reads_only_its_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train, test = _small_split()
    written = write_shard_dir(tmp_path, train, test, num_shards=5)
    assert [p.name for p in written] == [f"shard-{i:05d}.npz" for i in range(5)]
    assert (tmp_path / "test.npz").is_file()

    opened: list[str] = []
    real_read = datasets_module._read_npz

    def spy(file):
        opened.append(Path(file).name)
        return real_read(file)

    monkeypatch.setattr(datasets_module, "_read_npz", spy)
    mine = load_worker_shards(tmp_path, rank=1, world_size=2)
    assert opened == ["shard-00001.npz", "shard-00003.npz"]

    pieces = np.array_split(np.arange(len(train)), 5)
    expected = train.subset(np.concatenate([pieces[1], pieces[3]]))
    assert torch.equal(mine.x, expected.x) and torch.equal(mine.y, expected.y)
    assert mine.num_classes == 4  # recorded in the shard, not inferred from this worker's labels
    assert [p.name for p in worker_shard_files(tmp_path, 0, 2)] == [
        "shard-00000.npz",
        "shard-00002.npz",
        "shard-00004.npz",
    ]


def test_shard_dir_every_sample_goes_to_exactly_one_worker(tmp_path: Path) -> None:
    train, test = _small_split()
    write_shard_dir(tmp_path, train, test, num_shards=7)
    parts = [load_worker_shards(tmp_path, r, 3) for r in range(3)]
    rows = sorted(row for part in parts for row in part.x[:, 0].tolist())
    assert rows == train.x[:, 0].tolist()

    whole_train, whole_test = load_dataset("shards", path=tmp_path)
    assert torch.equal(whole_train.x, train.x) and torch.equal(whole_train.y, train.y)
    assert torch.equal(whole_test.x, test.x)
    loaded_test = load_shard_dir_test(tmp_path)
    assert torch.equal(loaded_test.x, test.x) and torch.equal(loaded_test.y, test.y)


def test_shard_dir_errors(tmp_path: Path) -> None:
    train, test = _small_split()
    write_shard_dir(tmp_path, train, test, num_shards=3)
    with pytest.raises(DataError, match="has 3 shard files but there are 4 workers"):
        load_worker_shards(tmp_path, 0, 4)
    with pytest.raises(ConfigError) as info:
        load_worker_shards(tmp_path, 2, 2)
    assert info.value.setting == "rank"
    with pytest.raises(ConfigError) as info:
        write_shard_dir(tmp_path, train, test, num_shards=0)
    assert info.value.setting == "num_shards"

    write_shard_dir(tmp_path, train, test, num_shards=2)  # rewriting removes the stale third shard
    assert sorted(p.name for p in tmp_path.glob("shard-*.npz")) == [
        "shard-00000.npz",
        "shard-00001.npz",
    ]

    (tmp_path / "shard-00000.npz").unlink()
    with pytest.raises(DataError, match="shard-00000.npz is missing"):
        load_worker_shards(tmp_path, 0, 1)


# ---------------------------------------------------------------------------------------------
# Partitions


def _skew(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> float:
    """Mean total-variation distance between each worker's label mix and the global mix."""
    overall = np.bincount(labels, minlength=num_classes) / len(labels)
    distances = []
    for stats in shard_stats(labels, parts, num_classes):
        mix = np.array(stats["label_histogram"]) / stats["size"]
        distances.append(0.5 * np.abs(mix - overall).sum())
    return float(np.mean(distances))


def test_iid_parts_are_equal_disjoint_and_cover_the_permutation() -> None:
    labels = np.arange(103) % 10
    parts = partition_indices(labels, world_size=4, seed=1)
    assert [len(p) for p in parts] == [25, 25, 25, 25]
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == 100  # disjoint; 3 samples dropped for equal sizes
    assert all(np.all(np.diff(p) > 0) for p in parts)

    whole = partition_indices(torch.as_tensor(labels[:100]), world_size=4, seed=1)
    assert np.array_equal(np.sort(np.concatenate(whole)), np.arange(100))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_partition_is_deterministic_by_seed(scheme: str) -> None:
    labels = np.random.default_rng(0).integers(0, 10, 500)
    a = partition_indices(labels, 5, scheme=scheme, seed=3)
    b = partition_indices(labels, 5, scheme=scheme, seed=3)
    c = partition_indices(labels, 5, scheme=scheme, seed=4)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c, strict=True))


def test_dirichlet_skew_follows_alpha() -> None:
    labels = np.repeat(np.arange(10), 200)
    skewed = partition_indices(labels, 8, scheme="dirichlet", alpha=0.1, seed=0)
    uniform = partition_indices(labels, 8, scheme="dirichlet", alpha=100.0, seed=0)
    for parts in (skewed, uniform):
        joined = np.concatenate(parts)
        assert np.array_equal(np.sort(joined), np.arange(len(labels)))  # disjoint, covers all
    assert _skew(labels, skewed, 10) > 0.5
    assert _skew(labels, uniform, 10) < 0.1


def test_dirichlet_leaves_no_worker_empty() -> None:
    labels = np.repeat(np.arange(3), 10)
    for seed in range(20):
        parts = partition_indices(labels, 30, scheme="dirichlet", alpha=0.01, seed=seed)
        assert all(len(p) >= 1 for p in parts)
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(30))


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"world_size": 2, "scheme": "round-robin"}, "--partition"),
        ({"world_size": 2, "scheme": "dirichlet", "alpha": 0.0}, "--dirichlet-alpha"),
        ({"world_size": 2, "scheme": "dirichlet", "alpha": -1.0}, "--dirichlet-alpha"),
        ({"world_size": 2, "scheme": "dirichlet", "alpha": float("nan")}, "--dirichlet-alpha"),
        ({"world_size": 2, "scheme": "dirichlet", "alpha": float("inf")}, "--dirichlet-alpha"),
        ({"world_size": 0}, "--workers"),
        ({"world_size": 11}, "--workers"),
    ],
)
def test_partition_rejects_bad_settings(kwargs, setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        partition_indices(np.arange(10) % 2, **kwargs)
    assert info.value.setting == setting


def test_shard_stats_counts_match_a_direct_count() -> None:
    labels = np.random.default_rng(1).integers(0, 6, 300)
    parts = partition_indices(labels, 3, scheme="dirichlet", alpha=0.5, seed=2)
    stats = shard_stats(torch.as_tensor(labels), parts, num_classes=7)
    for rank, (entry, part) in enumerate(zip(stats, parts, strict=True)):
        expected = [sum(1 for i in part if labels[i] == c) for c in range(7)]
        assert entry == {"rank": rank, "size": len(part), "label_histogram": expected}
    assert json.loads(json.dumps(stats)) == stats
    with pytest.raises(DataError, match="not below num_classes=5"):
        shard_stats(labels, parts, num_classes=5)


def test_eval_subset_spreads_a_fixed_choice_over_the_set_and_batches_like_it() -> None:
    from torch.utils.data import TensorDataset

    from distrain.data.batches import EvenSubset, batches_of, eval_subset
    from distrain.data.datasets import ArrayDataset

    x, y = torch.arange(100.0).unsqueeze(1), torch.arange(100) % 7
    for full in (ArrayDataset(x, y), TensorDataset(x, y)):
        assert eval_subset(full, 0) is full and eval_subset(full, 100) is full and eval_subset(full, 500) is full
        part = eval_subset(full, 8)
        assert isinstance(part, EvenSubset) and len(part) == 8
        picked = [int(part[i][0]) for i in range(8)]
        assert picked == sorted(set(picked)) and picked[0] == 0 and picked[-1] >= 80  # distinct, spread to the end
        assert all(b - a in (12, 13) for a, b in zip(picked, picked[1:], strict=False))
        bx, by = batches_of(part, torch.arange(8))
        assert bx.squeeze(1).tolist() == picked and by.dtype == torch.int64 and by.tolist() == [p % 7 for p in picked]
        assert [int(part[i][0]) for i in range(8)] == [int(eval_subset(full, 8)[i][0]) for i in range(8)]  # the same each time
