"""distrain.compare's grid logic with a stand-in launcher: order, skips, failures, files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import distrain.baselines
import distrain.launch
from distrain.compare import Grid, build_cells, load_scenario, run_comparison, split_list
from distrain.config import TrainConfig
from distrain.errors import ConfigError, WorkerFailure
from tests.unit.test_report import make_run

SPEED = {"allreduce": 1.0, "dpsgd": 2.0, "ddp": 0.9, "diloco": 1.5}


@pytest.fixture
def fake_launch(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    """Replace the launchers: write a synthesized run directory, or fail for dpsgd on 'edge'."""
    calls: list[TrainConfig] = []

    def launch(cfg: TrainConfig, name: str | None = None) -> dict:
        calls.append(cfg)
        name = name or cfg.algo.algorithm
        if name == "dpsgd" and cfg.network.network == "edge":
            raise WorkerFailure("worker 1 exited with status 1; the run was stopped")
        return make_run(Path(cfg.run.run_dir), algorithm=name, speed=SPEED[name] * (1 + cfg.run.seed / 10))

    monkeypatch.setattr(distrain.launch, "launch_local", launch)
    monkeypatch.setattr(distrain.baselines, "run_baseline", lambda spec, cfg: launch(cfg, spec))
    return calls


def base() -> TrainConfig:
    return TrainConfig.from_dict({"workers": 2, "dataset": "synthetic", "model": "mlp", "seed": 3})


def test_grid_runs_in_order_with_skips_and_failures(tmp_path: Path, fake_launch: list[TrainConfig]) -> None:
    grid = Grid(algorithms=["allreduce", "dpsgd", "ps"], networks=["lan", "edge"], baselines=["ddp"], repeats=2,
                out=tmp_path / "cmp")
    cfg = base()
    cfg.optim.optimizer = "lars"  # the parameter server refuses lars: ps is skipped on both networks
    lines: list[str] = []
    comparison = run_comparison(grid, cfg, echo=lines.append)

    labels = [row["label"] for row in comparison["configs"]]
    assert labels == ["allreduce @lan", "dpsgd @lan", "ps @lan", "ddp @lan",
                      "allreduce @edge", "dpsgd @edge", "ps @edge", "ddp @edge"]
    status = {row["label"]: row["status"] for row in comparison["configs"]}
    assert status["ps @lan"] == status["ps @edge"] == "skipped"
    assert status["dpsgd @edge"] == "failed" and status["dpsgd @lan"] == "ok"
    assert "--optimizer" in comparison["configs"][2]["reason"]
    assert "2 of 2 runs failed" in comparison["configs"][5]["reason"]
    # 6 runnable configurations x 2 repeats, seeds seed + k, each run in its own directory.
    assert len(fake_launch) == 12
    assert [c.run.seed for c in fake_launch[:2]] == [3, 4]
    assert len({c.run.run_dir for c in fake_launch}) == 12
    assert all(c.optim.optimizer == "lars" and c.cluster.workers == 2 for c in fake_launch)
    assert any(line.startswith("skipping ps @lan") for line in lines)

    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert saved["baseline"] == "allreduce @lan"
    for row in saved["configs"]:
        for run in row["runs"]:
            if run["status"] == "ok":
                summary = json.loads((tmp_path / "cmp" / run["run_dir"] / "summary.json").read_text())
                assert run["samples_per_s"] == summary["samples_per_s"]
                assert run["final_test_accuracy"] == summary["final_test_accuracy"]
    dp = next(r for r in saved["configs"] if r["label"] == "dpsgd @lan")
    means = [r["samples_per_s"] for r in dp["runs"]]
    base_means = [r["samples_per_s"] for r in saved["configs"][0]["runs"]]
    assert dp["samples_per_s"]["mean"] == pytest.approx(sum(means) / 2)
    assert dp["speedup_samples_per_s"] == pytest.approx(sum(means) / sum(base_means))

    with open(tmp_path / "cmp" / "comparison.csv") as f:
        assert [line["status"] for line in csv.DictReader(f)] == ["ok", "ok", "skipped", "ok", "ok", "failed", "skipped", "ok"]
    assert sorted(saved["plots"]) == ["accuracy_vs_epoch.png", "accuracy_vs_time.png", "bytes_sent_per_worker.png",
                                      "loss_vs_time.png", "quality_vs_bytes.png", "throughput_per_worker.png"]
    table = comparison["table"]
    assert "allreduce @lan (baseline)" in table and "skipped" in table and "failed 0/2" in table


def test_named_baseline_and_bad_grids(tmp_path: Path) -> None:
    cells = build_cells(Grid(algorithms=["allreduce"], compress=["none", "topk:0.1"], out=tmp_path), base())
    assert [c.label for c in cells] == ["allreduce", "allreduce+topk:0.1"]
    assert cells[1].slug == "allreduce+topk_0.1"
    cells = build_cells(Grid(algorithms=["allreduce", "dpsgd"], compress=["none", "topk:0.1"], out=tmp_path), base())
    assert [c.reason is None for c in cells] == [True, True, True, False]
    assert "dpsgd does not compress" in str(cells[3].reason)
    bad = [
        (Grid(algorithms=["nope"]), "--algorithms"),
        (Grid(compress=["topk:2"]), "--compress"),
        (Grid(networks=["moon"]), "--network"),
        (Grid(baselines=["ddp-nope"]), "--baselines"),
        (Grid(baselines=["ddp-powersgd:x"]), "--baselines"),
        (Grid(repeats=0), "--repeats"),
        (Grid(baseline="dpsgd"), "--baseline"),
        (Grid(algorithms=[], baselines=[]), "--algorithms"),
    ]
    for grid, flag in bad:
        with pytest.raises(ConfigError) as info:
            build_cells(grid, base())
        assert str(info.value).startswith(flag), (grid, str(info.value))
    with pytest.raises(ConfigError, match="--lr"):
        build_cells(Grid(), TrainConfig.from_dict({"lr": -1.0}))
    with pytest.raises(ConfigError, match="more than once"):
        split_list("allreduce,allreduce", "--algorithms")


def test_scenario_files_may_name_algorithms_not_yet_built(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('name = "demo"\nalgorithms = ["allreduce", "future-algo"]\nnetworks = ["edge"]\n'
                    'baselines = ["ddp"]\nrepeats = 2\n[train]\nworkers = 3\nepochs = 2\n')
    grid, train, name = load_scenario(path)
    assert name == "demo" and grid.repeats == 2 and train == {"workers": 3, "epochs": 2}
    cells = build_cells(grid, TrainConfig.from_dict(train))
    assert [c.label for c in cells] == ["allreduce", "future-algo", "ddp"]
    assert cells[1].reason is not None and "not in this build" in cells[1].reason
    (tmp_path / "bad.toml").write_text('algorithm = ["x"]\n')
    with pytest.raises(ConfigError, match="unknown key 'algorithm'"):
        load_scenario(tmp_path / "bad.toml")


def test_named_configurations_run_with_their_own_settings(tmp_path: Path, fake_launch: list[TrainConfig]) -> None:
    path = tmp_path / "h.toml"
    path.write_text('name = "sweep"\nalgorithms = ["allreduce"]\nnetworks = ["lan", "edge"]\nbaseline = "ddp @edge"\n'
                    'baselines = ["ddp"]\n[train]\nworkers = 2\ndataset = "synthetic"\nmodel = "mlp"\nsync_every = 8\n'
                    '[[configs]]\nlabel = "diloco H=16"\nalgorithm = "diloco"\nsync_every = 16\n'
                    '[[configs]]\nlabel = "diloco int8"\nalgorithm = "diloco"\ncompress = "int8"\n'
                    '[[configs]]\nlabel = "peer H=4"\nbaseline = "ddp"\nsync_every = 4\n')
    grid, train, _ = load_scenario(path)
    grid.out = tmp_path / "cmp"
    base_cfg = TrainConfig.from_dict(train)
    comparison = run_comparison(grid, base_cfg, echo=lambda line: None)
    assert [row["label"] for row in comparison["configs"]] == [
        "allreduce @lan", "diloco H=16 @lan", "diloco int8 @lan", "peer H=4 @lan", "ddp @lan",
        "allreduce @edge", "diloco H=16 @edge", "diloco int8 @edge", "peer H=4 @edge", "ddp @edge"]
    by_dir = {Path(c.run.run_dir).parent.name: c for c in fake_launch}
    h16, int8, peer = by_dir["diloco_H_16_edge"], by_dir["diloco_int8_edge"], by_dir["peer_H_4_edge"]
    assert (h16.algo.algorithm, h16.outer.sync_every, h16.compress.compress, h16.network.network) == ("diloco", 16, "none", "edge")
    assert (int8.outer.sync_every, int8.compress.compress) == (8, "int8")  # the shared setting where it sets none
    assert (peer.algo.algorithm, peer.outer.sync_every) == ("allreduce", 4)
    assert base_cfg.outer.sync_every == 8  # the shared settings are not edited
    assert comparison["baseline"] == "ddp @edge"
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert saved["grid"]["configs"][0] == {"label": "diloco H=16", "algorithm": "diloco", "sync_every": 16}

    bad = [
        ([{"algorithm": "diloco"}], "needs a label"),
        ([{"label": "x"}], "exactly one of"),
        ([{"label": "x", "algorithm": "diloco", "baseline": "ddp"}], "exactly one of"),
        ([{"label": "x", "algorithm": "nope"}], "unknown algorithm 'nope'"),
        ([{"label": "x", "baseline": "ddp-nope"}], "--baselines"),
        ([{"label": "x", "baseline": "ddp", "compress": "int8"}], "its own compression"),
        ([{"label": "x", "algorithm": "diloco", "network": "edge"}], "networks apply to every"),
        ([{"label": "x", "algorithm": "diloco", "no_such_setting": 1}], "configuration 'x'"),
        ([{"label": "x", "algorithm": "diloco", "sync_every": "often"}], "configuration 'x'"),
        ([{"label": "x", "algorithm": "diloco"}, {"label": "x", "algorithm": "allreduce"}], "more than one"),
        (["diloco"], "table of settings"),
    ]
    for configs, message in bad:
        with pytest.raises(ConfigError, match=message):
            build_cells(Grid(algorithms=[], configs=configs, out=tmp_path), base())
    cells = build_cells(Grid(algorithms=[], configs=[{"label": "x", "algorithm": "diloco", "sync_every": 0}]), base())
    assert cells[0].reason is not None and "--sync-every" in cells[0].reason  # an invalid run is skipped with its reason


def test_a_stop_request_ends_the_grid_and_keeps_what_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distrain.errors import Interrupted

    def launch(cfg: TrainConfig) -> dict:
        if cfg.algo.algorithm == "dpsgd":  # SIGTERM reached the workers of the second configuration
            raise Interrupted(3, cfg.run.run_dir)
        return make_run(Path(cfg.run.run_dir), algorithm=cfg.algo.algorithm, speed=1.0)

    monkeypatch.setattr(distrain.launch, "launch_local", launch)
    with pytest.raises(Interrupted):
        run_comparison(Grid(algorithms=["allreduce", "dpsgd", "d2"], out=tmp_path / "cmp"), base(), echo=lambda line: None)
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert [row["label"] for row in saved["configs"]] == ["allreduce"]  # d2 never started
