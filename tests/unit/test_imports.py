"""Optional packages: distrain's extras, and the one-line error naming the extra a feature needs.

Missing packages are simulated in-process by putting ``None`` in ``sys.modules`` (Python then
raises ModuleNotFoundError on import, as if the package were not installed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import distrain.launch
from distrain.cli import main
from distrain.compare import Grid, run_comparison
from distrain.config import TrainConfig
from distrain.data import load_dataset
from distrain.errors import ConfigError
from distrain.extras import PACKAGES, MissingExtraError, require
from distrain.report.plots import make_plots
from tests.unit.test_report import make_run

ROOT = Path(__file__).resolve().parents[2]


def block(monkeypatch: pytest.MonkeyPatch, top: str) -> None:
    """Make ``top`` and its submodules unimportable for the rest of the test."""
    for name in [top, *(m for m in list(sys.modules) if m.startswith(top + "."))]:
        monkeypatch.setitem(sys.modules, name, None)


def extra_line(feature: str, package: str, extra: str) -> str:
    return f"distrain: {feature} needs the {package!r} package: pip install 'distrain[{extra}]'"


def test_pyproject_core_dependencies_and_extras() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = [d.replace(" ", "") for d in project["dependencies"]]
    names = [d.split(">")[0].split("=")[0].split(";")[0].lower() for d in core]
    assert not {"matplotlib", "scikit-learn", "mnist1d", "pyyaml", "tokenizers"} & set(names)
    assert {"torch", "numpy", "tqdm", "tomli"} <= set(names)
    assert "tomli>=1.1;python_version<'3.11'" in core
    extras = {k: [d.split(">")[0].split("=")[0] for d in v] for k, v in project["optional-dependencies"].items()}
    assert extras["data"] == ["scikit-learn", "mnist1d"]
    assert extras["plots"] == ["matplotlib"]
    assert extras["yaml"] == ["PyYAML"]
    assert extras["lm"] == ["tokenizers"]
    assert extras["peers"] == ["torchft"]
    assert "torchft==0.2.0; sys_platform == 'linux'" in project["optional-dependencies"]["peers"]
    assert extras["all"] == ["distrain[data,plots,yaml,lm,peers]"]
    assert "distrain[all]" in extras["dev"]
    # Every package the code asks for by name is installed by the extra the error names.
    for package, extra in PACKAGES.values():
        assert package in extras[extra]


@pytest.mark.parametrize("index", [None, "https://download.pytorch.org/whl/cpu"])
def test_make_setup_takes_torch_from_torch_index(index: str | None, tmp_path: Path) -> None:
    args = ["make", "-n", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}", "setup"]
    out = subprocess.run(args + ([f"TORCH_INDEX={index}"] if index else []), capture_output=True, text=True,
                         timeout=30, check=True).stdout
    torch_line = next(line for line in out.splitlines() if '"torch==' in line)
    assert ("--index-url" in torch_line) == (index is not None)
    if index:
        assert f'--index-url "{index}"' in torch_line
    assert 'pip install -q -e ".[dev]"' in out  # dev brings every extra


def test_require_names_the_extra_and_is_an_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    block(monkeypatch, "mnist1d")
    with pytest.raises(ImportError) as info:
        require("mnist1d.data", feature="--dataset mnist1d", setting="--dataset")
    err = info.value
    assert isinstance(err, MissingExtraError) and isinstance(err, ConfigError)
    assert str(err) == "--dataset mnist1d needs the 'mnist1d' package: pip install 'distrain[data]'"
    assert (err.name, err.extra, err.setting) == ("mnist1d", "data", "--dataset")


def test_mnist1d_without_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = load_dataset("mnist1d", num_samples=100, seed=0, cache_dir=tmp_path / "cache")
    block(monkeypatch, "mnist1d")
    # A cached draw needs no generator ...
    again = load_dataset("mnist1d", num_samples=100, seed=0, cache_dir=tmp_path / "cache")
    assert (again[0].x == cached[0].x).all()
    # ... a new one names the extra, and writes nothing (not even the cache directory).
    with pytest.raises(MissingExtraError, match=r"pip install 'distrain\[data\]'"):
        load_dataset("mnist1d", num_samples=100, seed=0, cache_dir=tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


def test_cli_digits_without_scikit_learn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    block(monkeypatch, "sklearn")
    code = main(["train", "--dataset", "digits", "--model", "cnn2d", "--workers", "2", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.splitlines()
    assert code == 2
    assert err == [extra_line("--dataset digits", "scikit-learn", "data")]
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file()]


def test_cli_yaml_config_without_pyyaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    block(monkeypatch, "yaml")
    config = tmp_path / "run.yaml"
    config.write_text("lr: 0.05\n")
    code = main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [extra_line("--config run.yaml", "PyYAML", "yaml")]
    assert not (tmp_path / "run").exists()


def test_report_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    make_run(tmp_path / "runs" / "a")
    block(monkeypatch, "matplotlib")
    with pytest.raises(MissingExtraError, match=r"pip install 'distrain\[plots\]'"):
        make_plots({}, tmp_path / "plots")
    code = main(["report", str(tmp_path / "runs" / "a"), "--out", str(tmp_path / "plots")])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [extra_line("plotting", "matplotlib", "plots")]
    assert not (tmp_path / "plots").exists()


def test_compare_without_matplotlib_keeps_the_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distrain.launch, "launch_local", lambda cfg: make_run(Path(cfg.run.run_dir), acc_end=0.75))
    block(monkeypatch, "matplotlib")
    lines: list[str] = []
    cfg = TrainConfig.from_dict({"workers": 2, "dataset": "synthetic", "model": "mlp"})
    run_comparison(Grid(algorithms=["allreduce"], out=tmp_path / "cmp"), cfg, echo=lines.append)
    assert lines[-1] == ("plots failed (MissingExtraError: plotting needs the 'matplotlib' package: pip install 'distrain[plots]'); "
                         "the numbers are in comparison.json")
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert saved["plots"] == []
    assert [run["final_test_accuracy"] for run in saved["configs"][0]["runs"]] == [0.75]
