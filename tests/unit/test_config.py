"""Configuration: flags map one-to-one to fields, files load, bad values name their flag."""

from __future__ import annotations

import json
import math

import pytest

from distrain.cli import build_parser, config_from_args
from distrain.config import TASK_DEFAULTS, TrainConfig, flag, leaf_fields
from distrain.errors import ConfigError


def test_every_leaf_field_has_a_unique_flag():
    names = [f.name for _, f, _ in leaf_fields()]
    assert len(names) == len(set(names))
    parser = build_parser()
    args = parser.parse_args(["train", "--lr", "0.3", "--no-progress", "--workers", "3"])
    cfg = config_from_args(args)
    assert (cfg.optim.lr, cfg.run.progress, cfg.cluster.workers) == (0.3, False, 3)
    assert cfg.data.batch_size == TrainConfig().data.batch_size  # untouched flags keep defaults


def test_flat_and_sectioned_dicts_are_equivalent():
    a = TrainConfig.from_dict({"lr": 0.2, "workers": 2, "model": "mlp"})
    b = TrainConfig.from_dict({"optim": {"lr": 0.2}, "cluster": {"workers": 2}, "model": {"model": "mlp"}})
    assert a == b
    assert a.get("lr") == 0.2


@pytest.mark.parametrize("suffix,text", [
    (".json", json.dumps({"optim": {"lr": 0.07}, "epochs": 3})),
    (".toml", "epochs = 3\n[optim]\nlr = 0.07\n"),
])
def test_config_file_then_flags_override(tmp_path, suffix, text):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    args = build_parser().parse_args(["train", "--config", str(path), "--epochs", "5"])
    cfg = config_from_args(args)
    assert cfg.optim.lr == 0.07 and cfg.run.epochs == 5


def test_config_file_errors_name_the_setting(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"learning_rate": 1}))
    with pytest.raises(ConfigError, match="learning_rate"):
        TrainConfig.from_file(bad)
    bad.write_text(json.dumps({"workers": "many"}))
    with pytest.raises(ConfigError, match="--workers"):
        TrainConfig.from_file(bad)
    with pytest.raises(ConfigError, match="--config"):
        TrainConfig.from_file(tmp_path / "missing.json")
    odd = tmp_path / "x.ini"
    odd.write_text("")
    with pytest.raises(ConfigError, match="--config"):
        TrainConfig.from_file(odd)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="--config: .*is not UTF-8 text"):  # was a UnicodeDecodeError
        TrainConfig.from_file(binary)
    with pytest.raises(ConfigError, match="--config: .*is a directory"):  # was "does not exist"
        TrainConfig.from_file(tmp_path)
    bad.write_text(json.dumps({"batchsize": 8}))  # a near miss is named, and the message stays short
    with pytest.raises(ConfigError, match=r"^batchsize: unknown setting; did you mean batch_size\?") as exc:
        TrainConfig.from_file(bad)
    assert len(str(exc.value)) < 200


def test_a_yaml_error_says_where_in_one_line(tmp_path):
    pytest.importorskip("yaml", reason="YAML config files need PyYAML")
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: 0.1\nepochs 3\nworkers: 2\n")  # the second line has no ':'
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_file(bad)
    assert "\n" not in str(exc.value) and "line 3, column 1" in str(exc.value) and "from line 2" in str(exc.value)


def test_scenario_file_errors_name_scenario(tmp_path):
    from distrain.compare import load_scenario

    with pytest.raises(ConfigError, match="^--scenario: .*does not exist"):
        load_scenario(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(ConfigError, match="^--scenario: cannot parse"):
        load_scenario(broken)


@pytest.mark.parametrize("name,value", [
    ("lr", 0.0), ("lr", -1.0), ("lr", math.nan), ("lr", math.inf), ("epochs", 0), ("batch_size", 0),
    ("workers", 0), ("momentum", 1.0), ("target_accuracy", 1.5), ("timeout", 0), ("eval_every", -1),
    ("dirichlet_alpha", 0), ("master_port", 70000), ("threads", 0), ("bucket_mb", 0), ("first_bucket_mb", -1),
    ("algorithm", "sgd9"), ("model", "resnet"), ("dataset", "cifar"), ("partition", "half"),
    ("lr_decay", "linear"), ("optimizer", "rmsprop"), ("ring", "star"), ("model_width", 0), ("run_dir", ""), ("run_dir", "  "),
])
def test_validation_names_the_flag(name, value):
    cfg = TrainConfig()
    cfg.set(name, value)
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert info.value.setting == flag(name)
    assert "\n" not in str(info.value)


def test_defaults_are_valid_and_round_trip():
    cfg = TrainConfig().validate()
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_a_language_model_gets_its_own_defaults_for_the_settings_not_given(tmp_path):
    generic, lm_defaults = TrainConfig(), TASK_DEFAULTS["lm"]
    cfg = TrainConfig.from_dict({"model": "gpt", "dataset": "text"}).validate()
    assert {name: cfg.get(name) for name in lm_defaults} == lm_defaults
    assert cfg.optim.momentum == generic.optim.momentum and cfg.cluster.workers == generic.cluster.workers
    # given settings stay, even when they equal the generic default; the rest take the task's
    given = {"model": "gpt", "dataset": "text", "epochs": generic.run.epochs, "lr": 0.01}
    cfg = TrainConfig.from_dict(given).validate()
    assert (cfg.run.epochs, cfg.optim.lr, cfg.data.batch_size) == (generic.run.epochs, 0.01, lm_defaults["batch_size"])
    args = build_parser().parse_args(["train", "--model", "gpt", "--dataset", "text", "--epochs", "2"])
    from_flags = config_from_args(args)
    assert from_flags.run.epochs == 2 and from_flags.optim.lr == lm_defaults["lr"]
    # a run's config.json gives every setting: it loads as the same run
    assert TrainConfig.from_dict(json.loads(json.dumps(from_flags.to_dict()))).validate() == from_flags
    # other tasks keep the generic defaults
    assert TrainConfig().validate() == generic
    assert TrainConfig.from_dict({"epochs": 3}).validate().optim.lr == generic.optim.lr


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_text_trains_a_language_model_only(task):
    """--dataset text with another task was a ValueError inside the workers."""
    with pytest.raises(ConfigError, match="^--task: --dataset text trains a language model"):
        TrainConfig.from_dict({"dataset": "text", "task": task}).validate()
    assert TrainConfig.from_dict({"dataset": "text", "task": "lm", "model": "gpt"}).validate().data.task_name() == "lm"
