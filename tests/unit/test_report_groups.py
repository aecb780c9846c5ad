"""distrain report groups runs by their whole configuration (every setting but the seed)."""

from __future__ import annotations

import json
from pathlib import Path

from distrain.cli import main
from distrain.report import report
from distrain.report.runs import group_runs, load_runs
from tests.unit.test_report import make_run


def run_with(path: Path, **sections: dict) -> None:
    make_run(path)
    config = json.loads((path / "config.json").read_text())
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    (path / "config.json").write_text(json.dumps(config))


def test_unrelated_runs_are_not_repeats_and_seeds_are(tmp_path):
    run_with(tmp_path / "a", data={"dataset": "digits"}, cluster={"workers": 2}, run={"seed": 0, "run_dir": "x"})
    run_with(tmp_path / "b", data={"dataset": "mnist1d"}, cluster={"workers": 4}, run={"seed": 0})
    run_with(tmp_path / "c", data={"dataset": "mnist1d"}, cluster={"workers": 4}, run={"seed": 1, "run_dir": "y"})
    groups = group_runs(load_runs([tmp_path]))
    sizes = {label: [r.path.name for r in runs] for label, runs in groups.items()}
    assert sizes == {"allreduce dataset=digits workers=2": ["a"], "allreduce dataset=mnist1d workers=4": ["b", "c"]}


def test_one_configuration_keeps_its_plain_label(tmp_path):
    for seed in range(3):
        run_with(tmp_path / f"r{seed}", run={"seed": seed, "name": f"r{seed}", "progress": seed == 1})
    assert {k: len(v) for k, v in group_runs(load_runs([tmp_path])).items()} == {"allreduce": 3}


def test_labels_name_the_runs_under_a_directory(tmp_path, capsys):
    run_with(tmp_path / "mine" / "a", optim={"lr": 0.1})
    run_with(tmp_path / "mine" / "b", optim={"lr": 0.2})
    run_with(tmp_path / "theirs", optim={"lr": 0.3})
    groups = group_runs(load_runs([tmp_path]), {str(tmp_path / "mine"): "my sweep"})
    assert {k: sorted(r.path.name for r in v) for k, v in groups.items()} == {"my sweep": ["a", "b"], "allreduce": ["theirs"]}
    code = main(["report", str(tmp_path), "--label", f"{tmp_path / 'mine'}=my sweep", "--out", str(tmp_path / "out")])
    table = capsys.readouterr().out
    assert code == 0 and "my sweep" in table and "2/2" in table


def test_a_single_run_reports_inside_itself(tmp_path):
    run_with(tmp_path / "one")
    files, _ = report([tmp_path / "one"])
    assert files and all(f.parent == tmp_path / "one" / "report" for f in files)
    assert not (tmp_path / "report").exists()


def test_a_bad_label_is_one_line(tmp_path, capsys):
    run_with(tmp_path / "one")
    assert main(["report", str(tmp_path / "one"), "--label", "no-equals-sign"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["distrain: --label: must look like RUN_DIR=NAME, got 'no-equals-sign'"]
