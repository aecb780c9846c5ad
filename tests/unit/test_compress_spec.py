"""``--compress`` specs and the compression settings: what is accepted, and one-line errors."""

from __future__ import annotations

import pytest

from distrain.cli import main
from distrain.compress import COMPRESSORS, ErrorFeedback, GroupTopK, build_compressor
from distrain.config import TrainConfig
from distrain.errors import ConfigError


@pytest.mark.parametrize("spec,name,ratio", [
    ("none", "none", None), ("fp16", "fp16", None), ("bf16", "bf16", None), ("topk:0.01", "topk", 0.01),
    ("randomk:1", "randomk", 1.0), ("group_topk:0.01", "group_topk", 0.01), ("qsgd:8bit", "qsgd", None),
    ("qsgd:4bit", "qsgd", None), ("qsgd", "qsgd", None), ("group_topk:0.5:group=7", "group_topk", 0.5),
    ("sparseloco:0.02", "sparseloco", 0.02), ("sparseloco:0.01:bits=1:chunk=2:decay=0.5", "sparseloco", 0.01),
])
def test_valid_specs_build(spec, name, ratio):
    c = build_compressor(spec)
    assert c.name == name and c.ratio == ratio


def test_group_size_and_bits_are_parsed():
    c = build_compressor("group_topk:0.02:group=256")
    assert isinstance(c, ErrorFeedback) and isinstance(c.inner, GroupTopK) and c.inner.group == 256
    assert build_compressor("group_topk:0.02").inner.group == 2**18
    assert build_compressor("qsgd:4bit").inner.bits == 4


@pytest.mark.parametrize("spec,words", [
    ("gzip", "choose one of"), ("topk", "needs one ratio"), ("topk:0", "(0, 1]"), ("topk:1.5", "(0, 1]"),
    ("topk:nan", "(0, 1]"), ("randomk:-0.1", "(0, 1]"), ("topk:abc", "(0, 1]"), ("group_topk:0.1:group=0", "group"),
    ("group_topk:0.1:group=x", "group"), ("group_topk:0.1:size=4", "unknown option"), ("qsgd:2bit", "8bit or 4bit"),
    ("fp16:0.5", "no argument"), ("topk:0.1:0.2", "one ratio"), ("sparseloco", "needs one ratio"),
    ("sparseloco:1.5", "(0, 1]"), ("sparseloco:0.02:bits=0", "bits must be an integer from 1 to 8"),
    ("sparseloco:0.02:bits=9", "from 1 to 8"), ("sparseloco:0.02:bits=two", "from 1 to 8"),
    ("sparseloco:0.02:chunk=1", "chunk must be an integer from 2"), ("sparseloco:0.02:chunk=4.5", "chunk"),
    ("sparseloco:0.02:chunk=99999999", "chunk"), ("sparseloco:0.02:decay=0", "decay must be in (0, 1]"),
    ("sparseloco:0.02:decay=1.1", "(0, 1]"), ("sparseloco:0.02:decay=x", "decay"),
    ("sparseloco:0.02:group=4", "unknown option"),
])
def test_bad_specs_are_one_line_config_errors(spec, words):
    with pytest.raises(ConfigError) as info:
        build_compressor(spec)
    assert info.value.setting == "--compress"
    assert words in info.value.message and "\n" not in str(info.value)


def test_unknown_name_lists_every_valid_name():
    with pytest.raises(ConfigError) as info:
        build_compressor("zip")
    for name in COMPRESSORS:
        assert name in info.value.message


@pytest.mark.parametrize("settings,flag", [
    ({"compress": "topk:2"}, "--compress"), ({"error_feedback": "maybe"}, "--error-feedback"),
    ({"sparse_collective": "tree"}, "--sparse-collective"), ({"density_warmup_epochs": -1}, "--density-warmup-epochs"),
    ({"density_decay_epochs": float("nan")}, "--density-decay-epochs"),
])
def test_compress_config_validation_names_the_flag(settings, flag):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(settings).validate()
    assert info.value.setting == flag


def test_cli_rejects_a_bad_spec_with_status_2(capsys):
    assert main(["train", "--compress", "group_topk:0:group=64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distrain: --compress:") and "(0, 1]" in err and len(err.splitlines()) == 1
    assert main(["train", "--algorithm", "diloco", "--compress", "sparseloco:0.02:bits=9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distrain: --compress: sparseloco:") and "from 1 to 8" in err and len(err.splitlines()) == 1
