"""distrain: communication-efficient distributed training over slow, uneven or shared networks."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from distrain.config import TrainConfig, copy_of
from distrain.errors import CheckpointError, ConfigError, DataError, DistrainError, WorkerFailure

__version__ = "0.1.0"


class FitResult(dict):
    """What :func:`fit` returns: the run summary (this object is that dict, as ``summary.json``
    holds it), and the trained model.

    Attributes:
        summary: the summary as a plain dict.
        state_dict: the trained model's parameters and buffers (the consensus model for
            decentralized algorithms), read from ``model.pt`` in the run directory with
            ``torch.load(..., weights_only=True)``; load them into ``model_fn()``.
    """

    @property
    def summary(self) -> dict[str, Any]:
        return dict(self)

    @property
    def state_dict(self) -> dict[str, Any]:
        import torch

        return torch.load(Path(self["run_dir"]) / "model.pt", weights_only=True)


def fit(model_fn: Any = None, train_set: Any = None, test_set: Any = None,
        config: TrainConfig | None = None, *, loss_fn: Any = None, **settings: Any) -> FitResult:
    """Train ``model_fn()`` on ``train_set`` with distrain's worker loop; returns the run summary
    and the trained model (:class:`FitResult`).

    Spawns ``workers`` local processes on 127.0.0.1, or, when this process was started by
    torchrun, runs as one of its workers (``workers`` is then torchrun's world size, and every
    rank returns the summary). A model or data set of the caller's own is recorded as such in
    ``config.json``, the summary and the run name: model ``user:<module>.<qualname>`` of
    ``model_fn``, data set ``user`` with ``num_samples`` its training plus test samples.

    Args:
        model_fn: a picklable zero-argument callable returning an ``nn.Module`` (a module-level
            function, not a lambda, when workers > 1); None uses ``config.model``.
        train_set, test_set: any ``torch.utils.data.Dataset`` of ``(input, target)`` pairs;
            None uses ``config.dataset``.
        config: a :class:`TrainConfig` to start from (copied, never modified); defaults if None.
        loss_fn: your own loss, ``loss_fn(output, targets)`` returning per-sample losses or
            their mean (picklable, like ``model_fn``); default: the task's (cross-entropy for
            ``task="classification"``, mean squared error for ``task="regression"``).
        **settings: single settings by field name, e.g. ``workers=2, lr=0.05``,
            ``task="regression", target_loss=0.05``.

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
            result = distrain.fit(make_model, train, test, workers=2, epochs=5, batch_size=32)
            print(result["final_test_accuracy"])
            model = make_model()
            model.load_state_dict(result.state_dict)
    """
    from distrain.assemble import check_in_effect
    from distrain.launch import in_torchrun, launch_local, run_torchrun_worker

    cfg = copy_of(config, "fit(model_fn, train_set, test_set, workers=4)")
    for name, value in settings.items():
        cfg.set(name, value)
    cfg.validate()
    check_in_effect(cfg)
    _check_callables(cfg, model_fn=model_fn, loss_fn=loss_fn)
    cfg = _as_given(cfg, model_fn, train_set, test_set)
    user = {"model_fn": model_fn, "train_set": train_set, "test_set": test_set, "loss_fn": loss_fn}
    if in_torchrun():
        summary = run_torchrun_worker(cfg, summary_everywhere=True, **user)
        assert summary is not None
        return FitResult(summary)
    return FitResult(launch_local(cfg, **user))


def _check_callables(cfg: TrainConfig, **functions: Any) -> None:
    """fit()'s ``model_fn`` and ``loss_fn``: callables, and picklable where the workers are
    processes of their own (more than one, outside torchrun), before any of them starts."""
    import pickle

    from distrain.launch import in_torchrun
    from distrain.launch.common import server_count

    processes = cfg.cluster.workers + server_count(cfg)
    for name, fn in functions.items():
        if fn is None:
            continue
        if not callable(fn):
            raise ConfigError(name, f"must be a callable, got {type(fn).__name__}")
        if processes > 1 and not in_torchrun():
            try:
                pickle.dumps(fn)
            except Exception:  # noqa: BLE001 - PicklingError, AttributeError, TypeError alike
                raise ConfigError(name, f"must be picklable to reach {processes} worker processes: a module-level "
                                  f"function, not a lambda or a function defined inside another (got "
                                  f"{getattr(fn, '__qualname__', type(fn).__name__)})") from None


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


__all__ = ["CheckpointError", "ConfigError", "DataError", "DistrainError", "DistributedOptimizer", "FitResult",
           "TrainConfig", "WorkerFailure", "fit", "wrap"]
