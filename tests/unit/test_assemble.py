"""distrain.assemble: every algorithm is built from settings made of the flags, and the settings
carry the flags' values (the density warm-up's defaults resolved)."""

from __future__ import annotations

import dataclasses

import pytest

from distrain.algorithms import ALGORITHMS
from distrain.algorithms.allreduce import AllReduceSettings
from distrain.algorithms.base import RunFacts
from distrain.algorithms.parameter_server import ServerSettings
from distrain.assemble import SETTINGS, allreduce_settings, build_algorithm, server_settings
from distrain.compress.settings import CompressionSettings
from distrain.config import TrainConfig


def test_every_algorithm_is_built_from_frozen_settings_of_its_own():
    assert set(SETTINGS) == set(ALGORITHMS)
    for name in ALGORITHMS:
        config = TrainConfig(algorithm=name, workers=4).validate()
        algorithm = build_algorithm(name, config)
        assert type(algorithm) is ALGORITHMS[name]
        assert algorithm.settings == SETTINGS[name](config)
        assert dataclasses.is_dataclass(algorithm.settings) and not hasattr(algorithm, "config")
        with pytest.raises(dataclasses.FrozenInstanceError):
            algorithm.settings.run = None


def test_settings_carry_the_flags():
    config = TrainConfig(bucket_mb=5.0, first_bucket_mb=1.0, ring="own", on_nonfinite="skip", compress="topk:0.1",
                         error_feedback="off", sparse_collective="ring", momentum_correction="off",
                         density_warmup_epochs=0.5, workers=3, min_workers=2, timeout=30.0, seed=7).validate()
    run = RunFacts(workers=3, min_workers=2, timeout=30.0, device="cpu", seed=7)
    compression = CompressionSettings(spec="topk:0.1", error_feedback=False, sparse_collective="ring",
                                      momentum_correction=False, density_warmup_epochs=0.5, density_decay_epochs=2.0)
    assert allreduce_settings(config) == AllReduceSettings(bucket_mb=5.0, first_bucket_mb=1.0, ring="own",
                                                           workers_per_node=0, on_nonfinite="skip",
                                                           compression=compression, run=run)
    config = TrainConfig(algorithm="ps", servers=2, ps_mode="async", max_staleness=2, checkpoint_every=5, model="mlp",
                         epochs=3, compress="int8", error_feedback="on", sparse_collective="allgather",
                         momentum_correction="on", workers=4, min_workers=1, timeout=60.0, seed=3).validate()
    # int8 keeps no ratio: no density warm-up unless asked for
    compression = CompressionSettings(spec="int8", error_feedback=True, sparse_collective="allgather",
                                      momentum_correction=True, density_warmup_epochs=0.0, density_decay_epochs=0.0)
    assert server_settings(config) == ServerSettings(
        servers=2, ps_mode="async", workers_per_node=0, compression=compression,
        run=RunFacts(workers=4, min_workers=1, timeout=60.0, device="cpu", seed=3), max_staleness=2,
        checkpoint_every=5, model="mlp", resume="none", epochs=3.0)


def test_a_lost_worker_joins_a_flat_ps_run_again():
    from distrain.errors import ConfigError

    for mode in ("sync", "async"):
        TrainConfig(algorithm="ps", servers=2, max_restarts=1, ps_mode=mode).validate()
    with pytest.raises(ConfigError, match="--max-restarts"):
        TrainConfig(algorithm="ps", servers=2, max_restarts=1, workers_per_node=2).validate()


def test_a_lost_worker_joins_adpsgd_and_prague_again():
    from distrain.errors import ConfigError

    TrainConfig(algorithm="adpsgd", max_restarts=1).validate()
    TrainConfig(algorithm="prague", max_restarts=1).validate()
    TrainConfig(algorithm="prague", max_restarts=1, resume="auto").validate()
    with pytest.raises(ConfigError, match="--workers"):  # prague's other checks stay
        TrainConfig(algorithm="prague", max_restarts=1, workers=1).validate()
