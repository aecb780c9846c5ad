"""Shared fixtures: a private data cache per test session, small configurations."""

from __future__ import annotations

import pytest

from distrain.config import TrainConfig


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    import os

    os.environ.setdefault("DISTRAIN_CACHE", str(tmp_path_factory.mktemp("cache")))


def small_config(run_dir: str, **settings: object) -> TrainConfig:
    """A quick job: synthetic data, a small MLP, no progress bar, short timeout."""
    base: dict[str, object] = {
        "dataset": "synthetic", "num_samples": 1200, "model": "mlp", "model_width": 32, "model_depth": 2,
        "batch_size": 16, "epochs": 1, "lr": 0.05, "warmup_epochs": 0, "lr_decay": "none", "progress": False,
        "timeout": 60, "run_dir": run_dir,
    }
    base.update(settings)
    return TrainConfig.from_dict(base).validate()
