"""distrain: communication-efficient distributed training over slow, uneven or shared networks."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from distrain.config import TrainConfig
from distrain.errors import CheckpointError, ConfigError, DataError, DistrainError, WorkerFailure

__version__ = "0.1.0"


def fit(model_fn: Any = None, train_set: Any = None, test_set: Any = None,
        config: TrainConfig | None = None, **settings: Any) -> dict[str, Any]:
    """Train ``model_fn()`` on ``train_set`` with distrain's worker loop; returns the run summary.

    Spawns ``workers`` local processes on 127.0.0.1, or, when this process was started by
    torchrun, runs as one of its workers (``workers`` is then torchrun's world size, and every
    rank returns the summary). A model or data set of the caller's own is recorded as such in
    ``config.json``, the summary and the run name: model ``user:<module>.<qualname>`` of
    ``model_fn``, data set ``user`` with ``num_samples`` its training plus test samples.

    Args:
        model_fn: a picklable zero-argument callable returning an ``nn.Module`` (a module-level
            function, not a lambda, when workers > 1); None uses ``config.model``.
        train_set, test_set: any ``torch.utils.data.Dataset`` of ``(input, label)`` pairs;
            None uses ``config.dataset``.
        config: a :class:`TrainConfig`; defaults if None.
        **settings: overrides of single settings by field name, e.g. ``workers=2, lr=0.05``.

    Example::

        import torch
        from torch.utils.data import TensorDataset
        import distrain

        def make_model():
            return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))

        if __name__ == "__main__":
            g = torch.Generator().manual_seed(0)
            x = torch.randn(2000, 20, generator=g)
            y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
            train, test = TensorDataset(x[:1600], y[:1600]), TensorDataset(x[1600:], y[1600:])
            summary = distrain.fit(make_model, train, test, workers=2, epochs=5, batch_size=32)
            print(summary["final_test_accuracy"])
    """
    from distrain.launch import in_torchrun, launch_local, run_torchrun_worker

    cfg = config or TrainConfig()
    for name, value in settings.items():
        cfg.set(name, value)
    cfg.validate()
    cfg = _as_given(cfg, model_fn, train_set, test_set)
    user = {"model_fn": model_fn, "train_set": train_set, "test_set": test_set}
    if in_torchrun():
        summary = run_torchrun_worker(cfg, summary_everywhere=True, **user)
        assert summary is not None
        return summary
    return launch_local(cfg, **user)


def _as_given(cfg: TrainConfig, model_fn: Any, train_set: Any, test_set: Any) -> TrainConfig:
    """``cfg`` naming the caller's own model and data instead of the settings they replace."""
    if model_fn is not None:
        module = getattr(model_fn, "__module__", None) or type(model_fn).__module__
        if module == "__main__":  # a function of the script being run: name the script
            module = Path(getattr(sys.modules["__main__"], "__file__", None) or "__main__").stem
        name = getattr(model_fn, "__qualname__", None) or type(model_fn).__qualname__
        cfg = replace(cfg, model=replace(cfg.model, model=f"user:{module}.{name}"))
    if train_set is not None:
        sizes = [len(s) for s in (train_set, test_set) if s is not None and hasattr(s, "__len__")]
        cfg = replace(cfg, data=replace(cfg.data, dataset="user", data_path=None,
                                        num_samples=sum(sizes) or cfg.data.num_samples))
    return cfg


def __getattr__(name: str) -> Any:
    # wrap() brings in the algorithms and torch.distributed: loaded when first used, so that
    # "import distrain" stays light.
    if name in ("wrap", "DistributedOptimizer"):
        from distrain import distributed as module

        return getattr(module, name)
    raise AttributeError(f"module 'distrain' has no attribute {name!r}")


__all__ = ["CheckpointError", "ConfigError", "DataError", "DistrainError", "DistributedOptimizer", "TrainConfig",
           "WorkerFailure", "fit", "wrap"]
