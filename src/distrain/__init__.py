"""distrain: communication-efficient distributed training over slow, uneven or shared networks."""

from __future__ import annotations

from typing import Any

from distrain.config import TrainConfig
from distrain.errors import CheckpointError, ConfigError, DataError, DistrainError, WorkerFailure

__version__ = "0.1.0"


def fit(model_fn: Any = None, train_set: Any = None, test_set: Any = None,
        config: TrainConfig | None = None, **settings: Any) -> dict[str, Any] | None:
    """Train ``model_fn()`` on ``train_set`` with distrain's worker loop; returns the run summary.

    Spawns ``workers`` local processes on 127.0.0.1, or, when this process was started by
    torchrun, runs as one of its workers (then only rank 0 gets the summary; others get None).

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
    user = {"model_fn": model_fn, "train_set": train_set, "test_set": test_set}
    if in_torchrun():
        return run_torchrun_worker(cfg, **user)
    return launch_local(cfg, **user)


__all__ = ["CheckpointError", "ConfigError", "DataError", "DistrainError", "TrainConfig", "WorkerFailure", "fit"]
