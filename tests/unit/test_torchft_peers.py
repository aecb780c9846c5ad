"""The torchft peers' options and refusals, the one-line error without torchft, and a lighthouse
that fails to start: an error, and its process reaped (tests/distributed/test_torchft_peers.py
runs a real one)."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest
import torch

from distrain.baselines import build_peer, check_baseline
from distrain.baselines.lighthouse import Lighthouse, lighthouse_program
from distrain.baselines.torchft_peers import outer_optimizer
from distrain.cli import main
from distrain.config import TrainConfig
from distrain.errors import ConfigError, DistrainError
from tests.unit.test_imports import block

BASELINES = Path(__file__).resolve().parents[2] / "src" / "distrain" / "baselines"
needs_torchft = pytest.mark.skipif(lighthouse_program() is None, reason="torchft (and its lighthouse) not installed: "
                                   "pip install 'distrain[peers]'")


def cfg(**settings: object) -> TrainConfig:
    return TrainConfig.from_dict({"workers": 2, "sync_every": 8, **settings}).validate()


@needs_torchft
def test_h_comes_from_the_option_or_sync_every() -> None:
    assert build_peer("torchft-diloco:3").period(cfg()) == 3
    assert build_peer("torchft-localsgd").period(cfg()) == 8
    check_baseline("torchft-diloco", cfg())
    check_baseline("torchft-localsgd:2", cfg(sync_every="auto"))  # auto does not matter when H is given


@needs_torchft
@pytest.mark.parametrize("spec,settings,flag", [
    ("torchft-diloco:0", {}, "--baselines"), ("torchft-localsgd:x", {}, "--baselines"),
    ("torchft-diloco:1.5", {}, "--baselines"), ("torchft-localsgd:-2", {}, "--baselines"),
    ("torchft-localsgd", {"sync_every": "auto"}, "--baselines"),
    ("torchft-diloco", {"fragments": 2}, "--fragments"), ("torchft-diloco", {"overlap_steps": 1}, "--overlap-steps"),
    ("torchft-localsgd", {"device": "cuda"}, "--device"),
    ("torchft-diloco", {"emulation": "netns"}, "--emulation"),
    ("torchft-diloco", {"compress": "int8"}, "--compress"),
])
def test_bad_options_and_settings_are_one_line_errors_naming_the_flag(spec: str, settings: dict, flag: str) -> None:
    config = TrainConfig.from_dict({"workers": 2, "sync_every": 8, **settings})  # cuda need not exist here
    with pytest.raises(ConfigError) as info:
        check_baseline(spec, config)
    assert info.value.setting == flag and "\n" not in str(info.value), str(info.value)


def test_without_torchft_compare_stops_before_any_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    block(monkeypatch, "torchft")
    out = tmp_path / "cmp"
    code = main(["compare", "--algorithms", "allreduce", "--baselines", "ddp,torchft-localsgd", "--out", str(out)])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "distrain: --baselines torchft-localsgd needs the 'torchft' package: pip install 'distrain[peers]'"]
    assert not out.exists()


def test_the_baselines_package_imports_torchft_only_inside_the_workers() -> None:
    for path in BASELINES.glob("*.py"):
        if path.name == "torchft_group.py":  # imported by a worker that runs a torchft peer
            continue
        top = [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.Import | ast.ImportFrom)]
        names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] == "torchft" or n.endswith("torchft_group")], path.name


@pytest.mark.parametrize("name,momentum,nesterov", [("nesterov", 0.9, True), ("sgd", 0.9, False),
                                                    ("nesterov", 0.0, False)])
def test_outer_optimizer_is_distrains(name: str, momentum: float, nesterov: bool) -> None:
    outer = cfg(outer_optimizer=name, outer_lr=0.7, outer_momentum=momentum).outer
    opt = outer_optimizer([torch.nn.Parameter(torch.zeros(2))], outer)
    # Nesterov without momentum is plain SGD, which torch asks for by name.
    assert opt.defaults["lr"] == 0.7 and opt.defaults["momentum"] == momentum and opt.defaults["nesterov"] is nesterov


def _pid_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("script,words,timeout", [("exit 3", "exited with status 3", 30.0),
                                                   ("exec sleep 30", "did not listen", 0.5)])
def test_a_lighthouse_that_fails_to_start_is_an_error_and_reaped(tmp_path: Path, script: str, words: str,
                                                                 timeout: float) -> None:
    program = tmp_path / "lighthouse"
    program.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\necho starting\n{script}\n")
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    house = Lighthouse(2, tmp_path / "lighthouse.log", start_timeout=timeout, program=str(program))
    with pytest.raises(DistrainError, match=words):
        with house:
            pass
    assert house.proc is None and _pid_is_gone(int((tmp_path / "pid").read_text()))
    assert "starting" in (tmp_path / "lighthouse.log").read_text()
