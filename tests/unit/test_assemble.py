"""distrain.assemble: every algorithm is built from settings made of the flags, and the settings
carry the flags' values (the density warm-up's defaults resolved)."""

from __future__ import annotations

import dataclasses

import pytest

from distrain.algorithms import ALGORITHMS
from distrain.algorithms.allreduce import AllReduceSettings
from distrain.algorithms.base import RunFacts
from distrain.algorithms.parameter_server import ServerSettings
from distrain.assemble import (
    SCOPES,
    SETTINGS,
    allreduce_settings,
    build_algorithm,
    check_in_effect,
    drop_out_of_effect,
    server_settings,
)
from distrain.compress.settings import CompressionSettings
from distrain.config import AUTO, TrainConfig
from distrain.errors import ConfigError


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


#: A valid value other than the default for every setting of SCOPES.
OTHER_VALUES = {
    "bucket_mb": 5.0, "first_bucket_mb": 1.0, "ring": "own", "servers": 2, "ps_mode": "async", "max_staleness": 2,
    "topology": "complete", "mixing": "metropolis", "gossip_order": "atc", "budget": "time", "max_lag": 5,
    "snapshot_every": 2.0, "time_budget": 5.0, "group_size": 2, "sync_every": 16,
    "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.5, "fragments": 2, "overlap_steps": 1,
    "comm_overhead": 0.2, "sync_every_min": 8, "sync_every_max": 256, "merge_weight": 0.5
}

#: Algorithms whose settings carry a setting they ignore: D2 always exchanges after its update.
IGNORED_THOUGH_CARRIED = {("gossip_order", "d2")}


def _all_settings(name: str, config: TrainConfig):
    """What algorithm ``name`` runs with (a parameter server's too)."""
    return SETTINGS[name](config), server_settings(config) if name == "ps" else None


def test_the_scopes_name_the_algorithms_whose_settings_carry_the_setting():
    # The reference: what each algorithm's settings object holds with the setting changed.
    assert set(OTHER_VALUES) == set(SCOPES)
    for setting, scope in SCOPES.items():
        for name in ALGORITHMS:
            changed = TrainConfig(**{setting: OTHER_VALUES[setting]})
            if setting == "max_staleness":
                changed.set("ps_mode", "async")
                base = TrainConfig(ps_mode="async")
            else:
                base = TrainConfig()
            carried = _all_settings(name, changed) != _all_settings(name, base)
            assert carried == (name in scope.algorithms or (setting, name) in IGNORED_THOUGH_CARRIED), (setting, name)


@pytest.mark.parametrize(("settings", "flag", "where"), [
    ({"servers": 2}, "--servers", "--algorithm ps (this run's is allreduce)"),
    ({"algorithm": "dpsgd", "sync_every": 16}, "--sync-every", "--algorithm diloco (this run's is dpsgd)"),
    ({"algorithm": "allreduce", "budget": "time"}, "--budget", "--algorithm adpsgd or prague (this run's is allreduce)"),
    ({"algorithm": "ps", "max_staleness": 3}, "--max-staleness", "with --ps-mode async"),
    ({"algorithm": "prague", "time_budget": 5}, "--time-budget", "with --budget time"),
    ({"algorithm": "diloco", "merge_weight": 0.5}, "--merge-weight", "with --overlap-steps above 0"),
])
def test_a_setting_that_would_take_no_effect_is_refused(settings, flag, where):
    config = TrainConfig(workers=4, **settings).validate()  # (a baseline's config may hold them: see below)
    with pytest.raises(ConfigError) as exc:
        check_in_effect(config)
    assert exc.value.setting == flag and where in exc.value.message


def test_settings_where_they_take_effect_or_at_their_default_pass():
    check_in_effect(TrainConfig(workers=4, algorithm="ps", servers=2, ps_mode="async", max_staleness=3).validate())
    check_in_effect(TrainConfig(workers=4, algorithm="prague", budget="time", time_budget=5, group_size=2).validate())
    check_in_effect(TrainConfig(workers=4, algorithm="diloco", sync_every=AUTO, comm_overhead=0.2).validate())
    check_in_effect(TrainConfig(workers=4, error_feedback="off", density_warmup_epochs=0.0))  # (not scoped)
    check_in_effect(TrainConfig(workers=4, algorithm="dpsgd", servers=1, sync_every=64))  # defaults: nothing to refuse


def test_a_comparison_gives_its_shared_settings_to_those_that_use_them():
    config = TrainConfig(workers=4, sync_every=16, servers=2, topology="complete")
    drop_out_of_effect(config)
    assert (config.outer.sync_every, config.ps.servers, config.algo.topology) == (64, 1, "ring")
    config = TrainConfig(workers=4, algorithm="diloco", sync_every=16, servers=2)
    drop_out_of_effect(config, keep=["servers"])  # a named configuration's own setting stays, to be refused
    assert (config.outer.sync_every, config.ps.servers) == (16, 2)
    with pytest.raises(ConfigError, match="--servers"):
        check_in_effect(config)
