"""Every benchmark scenario file parses, and each configuration of its grid is a valid run
(checked as `distrain compare` would before launching anything; nothing trains here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distrain.algorithms import ALGORITHMS
from distrain.compare import build_cells, load_scenario
from distrain.config import TrainConfig
from distrain.emulation import NetworkSettings

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios").glob("*.toml"))


def test_the_language_model_scenarios_are_there():
    assert {"lm-lan", "lm-edge"} <= {p.stem for p in SCENARIOS}


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario_grids_are_valid(path: Path):
    grid, train, name = load_scenario(path)
    assert name == path.stem
    cells = build_cells(grid, TrainConfig.from_dict({"progress": False, **train}))
    assert cells
    built = [c for c in cells if c.kind == "baseline" or c.algorithm in ALGORITHMS]
    # a compressor is tried with every algorithm: those that send no gradients skip it, by design
    ignored = [c for c in built if c.compress != "none" and not getattr(ALGORITHMS.get(c.algorithm), "compresses", True)]
    assert all(c.reason is not None and "does not compress" in c.reason for c in ignored)
    assert [(c.label, c.reason) for c in built if c.reason is not None and c not in ignored] == []
    assert any(c.reason is None for c in built)


@pytest.mark.parametrize("stem, bits_per_s, latency_s", [("lm-lan", 10e9, 1e-4), ("lm-edge", 20e6, 0.01),
                                                    ("lm-edge-slow", 10e6, 0.02)])
def test_language_model_scenarios(stem: str, bits_per_s: float, latency_s: float):
    grid, train, _ = load_scenario(next(p for p in SCENARIOS if p.stem == stem))
    cfg = TrainConfig.from_dict(train).validate()
    assert (cfg.model.model, cfg.model.model_size, cfg.data.dataset, cfg.data.task_name()) == ("gpt", "micro", "text", "lm")
    assert cfg.cluster.workers == 4
    for net in grid.networks:
        cfg.network.network = net
        settings = NetworkSettings.from_config(cfg.network)
        assert settings.bandwidth == pytest.approx(bits_per_s)
        assert settings.latency == pytest.approx(latency_s)


def test_lm_edge_slow_is_lm_edge_on_slower_links():
    """lm-edge-slow keeps lm-edge's job: only its links (and its name) differ."""
    _, edge, _ = load_scenario(next(p for p in SCENARIOS if p.stem == "lm-edge"))
    _, slow, _ = load_scenario(next(p for p in SCENARIOS if p.stem == "lm-edge-slow"))
    links = {"bandwidth", "latency"}
    assert {k: v for k, v in slow.items() if k not in links} == edge
    assert links <= set(slow)
