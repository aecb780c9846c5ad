"""The run's own inputs as a user types them: run directory, run name, config files and their
types, bandwidth units, and re-using a run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distrain.cli import main
from distrain.config import TrainConfig, choices_of, leaf_fields
from distrain.errors import ConfigError
from tests.reliability.common import QUICK, cli_env

pytestmark = pytest.mark.timeout(120)


def typed(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m distrain ARGS`` from ``tmp_path``, as a user types it."""
    return subprocess.run([sys.executable, "-m", "distrain", *args], cwd=tmp_path, env=cli_env("inputs"),
                          capture_output=True, text=True, timeout=90)


def _files(directory: Path) -> dict[Path, tuple[int, bytes]]:
    """Every file under ``directory``: when it was last written, and what it holds."""
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.rglob("*") if p.is_file()}


def refused(capsys, *args: str) -> str:  # noqa: ANN001
    """``distrain train ARGS`` in this process: exit 2 and one stderr line, which is returned."""
    try:
        code = main(["train", *QUICK, *args])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


def test_run_dir_that_is_a_file_is_refused_as_typed(tmp_path):
    target = tmp_path / "results.txt"
    target.write_text("a user's file\n")
    out = typed(tmp_path, "train", *QUICK, "--workers", "2", "--run-dir", str(target))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("distrain: --run-dir:") and "not a directory" in lines[0]
    assert target.read_text() == "a user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]  # nothing written, not even runs/


def test_run_dirs_that_cannot_be_written(capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "is not a directory" in refused(capsys, "--run-dir", str(blocker / "run"))
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    line = refused(capsys, "--run-dir", str(locked / "run"))
    assert line.startswith("distrain: --run-dir:") and "not writable" in line
    assert not (locked / "run").exists()


def test_name_is_one_path_component_as_typed(tmp_path):
    (tmp_path / "work").mkdir()
    out = typed(tmp_path / "work", "train", *QUICK, "--workers", "2", "--name", "../../escape")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("distrain: --name:") and "one path component" in lines[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["work"]


@pytest.mark.parametrize("name", ["a/b", "..", ".", "", "a\\b"])
def test_names_that_are_not_one_component(capsys, name):
    assert refused(capsys, "--name", name).startswith("distrain: --name:")


@pytest.mark.parametrize("settings,flag,expected", [
    ({"workers": True}, "--workers", "an integer"),
    ({"epochs": True}, "--epochs", "a number"),
    ({"lr": "0.1"}, "--lr", "a number"),
    ({"lr_scaling": 1}, "--lr-scaling", "true or false"),
    ({"progress": "false"}, "--progress", "true or false"),
    ({"batch_size": 2.5}, "--batch-size", "an integer"),
    ({"compress": 0}, "--compress", "a string"),
    ({"epochs": None}, "--epochs", "a number, got null"),
])
def test_config_file_types_must_match(tmp_path, settings, flag, expected):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(settings))
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_file(path)
    assert str(exc.value).startswith(f"{flag}: expected {expected}")
    assert "\n" not in str(exc.value)


def test_config_file_values_of_the_right_type(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("workers = 2.0\nepochs = 3\nlr_scaling = false\n[optim]\nlr = 1\n")
    cfg = TrainConfig.from_file(path).validate()
    assert (cfg.cluster.workers, cfg.run.epochs, cfg.optim.lr_scaling, cfg.optim.lr) == (2, 3.0, False, 1.0)
    assert type(cfg.cluster.workers) is int and type(cfg.run.epochs) is float


def test_a_mismatched_type_in_a_config_file_as_typed(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"workers": True}))
    out = typed(tmp_path, "train", "--config", "run.json")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == ["distrain: --workers: expected an integer, got True"]


def test_choices_have_one_source(capsys):
    """Each setting's allowed values come from its field; validation refuses what help does not list."""
    checked = 0
    for _, field, _ in leaf_fields():
        choices = choices_of(field)
        if not choices:
            continue
        line = refused(capsys, f"--{field.name.replace('_', '-')}", "no-such-value")
        assert line == f"distrain: --{field.name.replace('_', '-')}: unknown value 'no-such-value'; choose one of: {', '.join(choices)}"
        checked += 1
    assert checked >= 15


def test_yaml_without_pyyaml_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text("workers: 2\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_file(path)
    assert str(exc.value).startswith("--config") and str(exc.value).endswith("pip install 'distrain[yaml]'")


def test_keyword_construction_and_version(capsys):
    cfg = TrainConfig(workers=2, epochs=3, model="mlp")
    assert (cfg.cluster.workers, cfg.run.epochs, cfg.model.model) == (2, 3, "mlp")
    assert TrainConfig(workers=2).to_dict() == TrainConfig.from_dict({"workers": 2}).to_dict()
    with pytest.raises(ConfigError, match="unknown setting"):
        TrainConfig(wrokers=2)
    from distrain import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"distrain {__version__}"


def test_bandwidth_units_follow_tc_and_config_json_records_bits(tmp_path):
    """``mbps`` is megabytes per second as in tc; the run's config.json holds bit/s, and loads as
    the run's own --config."""
    run = tmp_path / "run"
    out = typed(tmp_path, "train", *QUICK, "--workers", "2", "--epochs", "0.2", "--run-dir", str(run),
                "--bandwidth", "10MBps", "--slow-link", "1:4mbit")
    assert out.returncode == 0, out.stderr
    record = json.loads((run / "config.json").read_text())
    assert record["network_bits_per_s"]["bandwidth"] == pytest.approx(80e6)
    assert record["network_bits_per_s"]["slow_link"] == {"1": pytest.approx(4e6)}
    again = TrainConfig.from_file(run / "config.json").validate()
    assert again.to_dict() == TrainConfig.from_dict({k: record[k] for k in again.to_dict()}).to_dict()
    assert again.network.bandwidth == "10MBps" and again.cluster.workers == 2


def test_a_run_dir_holding_an_earlier_run(tmp_path):
    """Refused without --resume or --overwrite; --overwrite removes the earlier run's files only."""
    run = tmp_path / "run"
    out = typed(tmp_path, "train", *QUICK, "--workers", "1", "--epochs", "0.1", "--run-dir", str(run),
                "--checkpoint-every", "2")
    assert out.returncode == 0, out.stderr
    (run / "notes.txt").write_text("mine\n")
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    again = typed(tmp_path, "train", *QUICK, "--workers", "2", "--epochs", "0.1", "--run-dir", str(run))
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1, again.stderr
    assert "--run-dir" in lines[0] and "--resume auto" in lines[0] and "--overwrite" in lines[0]
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing touched
    steps = sorted((run / "checkpoints").iterdir())
    assert len(steps) >= 2

    fresh = typed(tmp_path, "train", *QUICK, "--workers", "1", "--epochs", "0.05", "--run-dir", str(run), "--overwrite")
    assert fresh.returncode == 0, fresh.stderr
    assert (run / "notes.txt").read_text() == "mine\n"
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(left) == 1 and left != [steps[-1].name]  # only the new run's final checkpoint


@pytest.mark.parametrize("damage", ["removed", pytest.param("truncated", marks=pytest.mark.slow)])  # the same check
def test_resume_auto_does_not_start_afresh_over_a_run_that_ended(tmp_path, damage):
    """A finished run whose checkpoints are gone (or every one damaged): ``--resume auto`` finds
    nothing to go on from and is refused in one line, where it used to train again from step 0
    over the run's summary, metrics and model; nothing in the directory changes."""
    run = tmp_path / "run"
    first = typed(tmp_path, "train", *QUICK, "--workers", "1", "--epochs", "0.1", "--run-dir", str(run),
                  "--checkpoint-every", "2")
    assert first.returncode == 0, first.stderr
    if damage == "removed":
        for path in sorted((run / "checkpoints").rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (run / "checkpoints").rmdir()
    else:
        for path in (run / "checkpoints").rglob("rank-*.pt"):
            path.write_bytes(path.read_bytes()[:200])
    before = _files(run)
    again = typed(tmp_path, "train", *QUICK, "--workers", "1", "--epochs", "0.2", "--run-dir", str(run),
                  "--resume", "auto")
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2, again.stderr
    assert lines[-1].startswith("distrain: --resume:") and "holds a run that ended" in lines[-1], again.stderr
    assert "--overwrite" in lines[-1] and "Traceback" not in again.stderr
    assert _files(run) == before


def test_resume_auto_starts_a_run_that_left_no_summary(tmp_path):
    """A run directory with no summary.json (a run that died before its first checkpoint) has
    no result to lose: ``--resume auto`` starts it afresh, as a restarted job expects."""
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "rank0.jsonl").write_text('{"step": 0, "loss": 2.3}\n')
    out = typed(tmp_path, "train", *QUICK, "--workers", "1", "--epochs", "0.05", "--run-dir", str(run),
                "--resume", "auto")
    assert out.returncode == 0, out.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] >= 1


# `make test-all`: a run resumed at its target stays in CI (test_a_run_that_stopped_at_its_target_is_finished)
@pytest.mark.slow
def test_a_resumed_run_judged_by_another_target(tmp_path):
    """Resumed with another target, a run's time to target is when its earlier
    evaluations first met the new target (computed here from its metrics), not when they met
    the old one; one the earlier segment never met is not reported as met. config.json records
    what each resume changed."""
    run = tmp_path / "run"
    base = [*QUICK, "--workers", "1", "--eval-every", "0.05", "--checkpoint-every", "5", "--run-dir", str(run)]
    first = typed(tmp_path, "train", *base, "--epochs", "0.2", "--target-accuracy", "0.01")
    assert first.returncode == 0, first.stderr
    met = json.loads((run / "summary.json").read_text())["time_to_target_s"]
    evaluations = [r for r in map(json.loads, (run / "metrics" / "rank0.jsonl").read_text().splitlines())
                   if "test_accuracy" in r]
    assert met == evaluations[0]["time"]  # any evaluation meets 1%
    ends = [json.loads((run / "summary.json").read_text())["steps"]]
    again = typed(tmp_path, "train", *base, "--epochs", "0.3", "--target-loss", "1e-9", "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert json.loads((run / "summary.json").read_text())["time_to_target_s"] is None  # a loss of 1e-9: never met
    ends.append(json.loads((run / "summary.json").read_text())["steps"])
    third = typed(tmp_path, "train", *base, "--epochs", "0.4", "--target-accuracy", "0.01", "--resume", "auto")
    assert third.returncode == 0, third.stderr
    assert json.loads((run / "summary.json").read_text())["time_to_target_s"] == met
    # config.json holds the last segment's settings, and what each resume changed, from the step it resumed at
    config = json.loads((run / "config.json").read_text())
    assert (config["run"]["target_accuracy"], config["run"]["target_loss"]) == (0.01, None)
    assert config["changed_on_resume"] == [
        {"from_step": ends[0], "settings": {"target_accuracy": [0.01, 0.95], "target_loss": [None, 1e-9]}},
        {"from_step": ends[1], "settings": {"target_accuracy": [0.95, 0.01], "target_loss": [1e-9, None]}},
    ]
    assert f"resumed at step {ends[1]} with other settings" in third.stderr and "--target-loss 1e-09 -> None" in third.stderr


def test_a_run_that_stopped_at_its_target_is_finished(tmp_path):
    """Ended by --stop-at-target, a run resumed with --stop-at-target and the same target has
    nothing to do and changes nothing (it used to train on past where it stopped); without
    --stop-at-target it trains further."""
    run = tmp_path / "run"
    base = [*QUICK, "--workers", "1", "--epochs", "2", "--eval-every", "0.05", "--checkpoint-every", "5",
            "--target-accuracy", "0.3", "--run-dir", str(run)]
    first = typed(tmp_path, "train", *base, "--stop-at-target")
    assert first.returncode == 0, first.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_at_target"] is True
    before = _files(run)
    again = typed(tmp_path, "train", *base, "--stop-at-target", "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "stopped at its target" in again.stdout + again.stderr and "nothing to do" in again.stdout + again.stderr
    assert _files(run) == before
    further = typed(tmp_path, "train", *base, "--resume", "auto")
    assert further.returncode == 0, further.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] > summary["steps"]


@pytest.mark.parametrize("workers,bad", [("2", ["--batch-size", "100000"]),
                                         pytest.param("2", ["--slow-worker", "5:4x"], marks=pytest.mark.slow),
                                         pytest.param("1", ["--batch-size", "100000"], marks=pytest.mark.slow)])
def test_overwrite_keeps_the_earlier_run_when_another_setting_is_refused(tmp_path, workers, bad):
    """--overwrite with a typo elsewhere: the start is refused in one line and the earlier run is
    still there, whole (it used to be removed before the other checks ran)."""
    run = tmp_path / "run"
    first = typed(tmp_path, "train", *QUICK, "--workers", "1", "--epochs", "0.05", "--run-dir", str(run))
    assert first.returncode == 0, first.stderr
    before = _files(run)
    again = typed(tmp_path, "train", *QUICK, "--workers", workers, "--epochs", "0.05", "--run-dir", str(run),
                  "--overwrite", *bad)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and lines[-1].startswith(f"distrain: {bad[0]}:"), again.stderr
    assert _files(run) == before


@pytest.mark.parametrize("workers,change,before,after", [
    ("2", ["--model-width", "64"], "--model-width 32", "--model-width 64"),
    pytest.param("1", ["--model-width", "64"], "--model-width 32", "--model-width 64", marks=pytest.mark.slow),  # in the loop
    pytest.param("2", ["--seed", "5"], "--seed 0", "--seed 5", marks=pytest.mark.slow),
])
def test_resume_with_a_model_or_split_of_other_shapes_is_refused_in_one_line(tmp_path, workers, change, before, after):
    """A checkpoint of a --model-width 32 run resumed with --model-width 64: one line naming the
    setting on both sides, exit 2 (it was PyTorch's size-mismatch error from load_state_dict);
    another --seed (which deals the data out anew) likewise (it was accepted in silence)."""
    run = tmp_path / "run"
    first = typed(tmp_path, "train", *QUICK, "--workers", workers, "--epochs", "0.05", "--run-dir", str(run))
    assert first.returncode == 0, first.stderr
    again = typed(tmp_path, "train", *QUICK, "--workers", workers, "--epochs", "0.1", "--run-dir", str(run),
                  *change, "--resume", "auto")
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert before in lines[-1] and after in lines[-1], again.stderr


def test_overwrite_and_resume_do_not_combine(capsys):
    assert refused(capsys, "--overwrite", "--resume", "auto").startswith("distrain: --overwrite:")


def test_a_refused_start_leaves_no_run_directory(tmp_path):
    run = tmp_path / "run"
    out = typed(tmp_path, "train", *QUICK, "--workers", "4", "--batch-size", "10000", "--run-dir", str(run))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not run.exists()
