"""The text data set: the local corpus, its split by whole files, windows inside one split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distrain.config import TrainConfig
from distrain.data import load_dataset
from distrain.data.text import VAL_EVERY, TextWindows, corpus_files, load_text, split_corpus
from distrain.errors import ConfigError


def write_corpus(root, n: int = 45) -> list:
    files = []
    for i in range(n):
        f = root / f"doc{i:03d}.txt"
        f.write_bytes(bytes([65 + i % 26]) * (300 + 7 * i) + b"\n")
        files.append(f)
    return files


def test_validation_holds_whole_files_and_the_split_is_deterministic(tmp_path):
    (tmp_path / "corpus").mkdir()
    files = write_corpus(tmp_path / "corpus")
    root, found = corpus_files(tmp_path / "corpus")
    assert found == sorted(files)
    train, val, info = split_corpus(root, found)
    held = [f for i, f in enumerate(found) if i % VAL_EVERY == VAL_EVERY - 1]
    assert val == b"".join(f.read_bytes() for f in held)
    assert train == b"".join(f.read_bytes() for f in found if f not in held)
    assert info["val_files"] == len(held) == 2 and info["bytes"] == len(train) + len(val)
    assert split_corpus(root, found) == (train, val, info)  # same corpus, same split, same hash


def test_windows_are_next_token_pairs_inside_their_split(tmp_path):
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus")
    train, val = load_text(tmp_path / "corpus", context=16, cache_dir=tmp_path / "cache")
    raw_train, raw_val, _ = split_corpus(*corpus_files(tmp_path / "corpus"))
    assert len(train) == (len(raw_train) - 1) // 16 and len(val) == (len(raw_val) - 1) // 16
    x, y = train.batch(torch.tensor([0, len(train) - 1]))
    assert x.dtype == torch.int64 and x.shape == (2, 16)
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    last = (len(train) - 1) * 16
    assert bytes(y[1].tolist()) == raw_train[last + 1 : last + 17]  # the last window ends inside training text
    assert list(train[3][0]) == list(raw_train[48:64])
    with pytest.raises(IndexError):
        train.batch(torch.tensor([len(train)]))
    again, _ = load_text(tmp_path / "corpus", context=16, cache_dir=tmp_path / "cache")  # from the cache
    assert isinstance(again.tokens, np.memmap) and np.array_equal(np.asarray(again.tokens), np.asarray(train.tokens))


def test_a_single_file_holds_out_its_tail_at_a_line_start(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(b"".join(b"line %04d of the text\n" % i for i in range(400)))
    train, val, info = split_corpus(*corpus_files(f))
    assert train + val == f.read_bytes() and train.endswith(b"\n") and 0.04 < len(val) / len(train + val) < 0.07


def test_the_default_corpus_is_the_standard_library(tmp_path):
    train, val = load_dataset("text", context=128, cache_dir=tmp_path)
    assert isinstance(train, TextWindows) and train.num_classes == 256 and train.input_shape == (128,)
    assert train.info["corpus"] == "python-stdlib" and train.info["bytes"] > 5_000_000
    assert len(val) > 1000 and len(train) > 19 * len(val) * 0.5


def test_text_settings():
    cfg = TrainConfig.from_dict({"model": "gpt", "dataset": "text"}).validate()
    assert cfg.data.task_name() == "lm"
    with pytest.raises(ConfigError, match="--model: gpt is a language model"):
        TrainConfig.from_dict({"model": "gpt"}).validate()
    with pytest.raises(ConfigError, match="--model: mlp is not a language model"):
        TrainConfig.from_dict({"model": "mlp", "dataset": "text"}).validate()
    with pytest.raises(ConfigError, match="--partition"):
        TrainConfig.from_dict({"model": "gpt", "dataset": "text", "partition": "dirichlet"}).validate()
    with pytest.raises(ConfigError, match="--context"):
        TrainConfig.from_dict({"model": "gpt", "dataset": "text", "context": 0}).validate()
