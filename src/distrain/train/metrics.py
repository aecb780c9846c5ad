"""Per-step metrics lines, evaluation, and the run summary."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from distrain.data import ArrayDataset


class MetricsWriter:
    """Appends one JSON object per line to ``metrics/rank<r>.jsonl`` in the run directory."""

    def __init__(self, run_dir: str | Path, rank: int, append: bool = False) -> None:
        path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a" if append else "w", buffering=1 << 16)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: str | Path, rank: int = 0) -> list[dict[str, Any]]:
    """The metrics lines of one worker of a finished run."""
    path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def batches_of(dataset: Dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetch the samples at ``indices`` as (inputs, labels) tensors."""
    if isinstance(dataset, ArrayDataset):
        return dataset.x[indices], dataset.y[indices]
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0][indices], dataset.tensors[1][indices].long()
    items = [dataset[int(i)] for i in indices]
    xs = torch.stack([torch.as_tensor(x) for x, _ in items])
    ys = torch.as_tensor([int(y) for _, y in items], dtype=torch.long)
    return xs, ys


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 1024) -> tuple[float, float]:
    """Test accuracy (0..1) and mean cross-entropy of ``model`` on ``dataset``."""
    was_training = model.training
    model.eval()
    correct, loss_sum, n = 0, 0.0, len(dataset)  # type: ignore[arg-type]
    for start in range(0, n, batch_size):
        x, y = batches_of(dataset, torch.arange(start, min(start + batch_size, n)))
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
    model.train(was_training)
    return correct / n, loss_sum / n


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON via a temp file and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(_finite(data), f, indent=2, allow_nan=False, default=_json_default)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return _finite(value.tolist())
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
