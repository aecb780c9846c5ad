"""Data for distrain: load data sets as in-memory tensors and split them among workers."""

from distrain.data.batches import batches_of
from distrain.data.datasets import (
    DATASETS,
    ArrayDataset,
    load_dataset,
    load_shard_dir_test,
    load_worker_shards,
    read_idx,
    worker_shard_files,
    write_shard_dir,
)
from distrain.data.partition import PARTITION_SCHEMES, labels_of, partition_indices, shard_stats

__all__ = [
    "DATASETS",
    "PARTITION_SCHEMES",
    "ArrayDataset",
    "batches_of",
    "labels_of",
    "load_dataset",
    "load_shard_dir_test",
    "load_worker_shards",
    "partition_indices",
    "read_idx",
    "shard_stats",
    "worker_shard_files",
    "write_shard_dir",
]
