"""--tokenizer bpe:N: a byte-level BPE trained on the training text, its cache, and bits per byte."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distrain.cli import main
from distrain.config import TrainConfig
from distrain.data.text import corpus_files, load_text, load_tokenizer, split_corpus
from distrain.data.tokenizer import BPE, TokenizerSpec, parse_tokenizer, train_bpe
from distrain.errors import ConfigError
from distrain.models import build_model
from distrain.sample import sample_text
from distrain.tasks import build_task

pytest.importorskip("tokenizers")

CODE = """def area(width, height):
    \"\"\"The area of a rectangle: {n} and more.\"\"\"
    return width * height  # café, naïve: bytes past ASCII


class Shape{n}:
    def __init__(self, name):
        self.name = name
"""


def write_corpus(root, n: int = 40) -> None:
    root.mkdir()
    for i in range(n):
        (root / f"mod{i:02d}.py").write_text(CODE.format(n=i) * (1 + i % 3))


def test_specs():
    assert parse_tokenizer("bytes") == TokenizerSpec("bytes", 256)
    assert parse_tokenizer("bpe:300") == TokenizerSpec("bpe", 300) and str(parse_tokenizer("bpe:300")) == "bpe:300"
    for bad in ("bpe:0", "bpe:x", "foo", "bpe:256", "bpe:70000", "bpe:", ""):
        with pytest.raises(ConfigError, match="^--tokenizer: must be 'bytes' or 'bpe:N'"):
            parse_tokenizer(bad)
    with pytest.raises(ConfigError, match="--tokenizer: bpe:300 tokenizes --dataset text, not mnist1d"):
        TrainConfig.from_dict({"tokenizer": "bpe:300"}).validate()
    assert TrainConfig.from_dict({"model": "gpt", "dataset": "text", "tokenizer": "bpe:300"}).validate()


def test_bad_spec_and_missing_package_are_one_line_before_any_worker(capsys, monkeypatch, tmp_path):
    run = tmp_path / "run"
    base = ["train", "--model", "gpt", "--dataset", "text", "--run-dir", str(run), "--no-progress"]
    assert main([*base, "--tokenizer", "bpe:x"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "distrain: --tokenizer: must be 'bytes' or 'bpe:N' with 256 < N <= 65536 (the BPE vocabulary, the 256 bytes "
        "included), got 'bpe:x'"]
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    assert main([*base, "--tokenizer", "bpe:512"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "distrain: --tokenizer bpe:512 needs the 'tokenizers' package: pip install 'distrain[lm]'"]
    assert not run.exists()


def test_bpe_round_trip(tmp_path):
    text = "".join(CODE.format(n=i) for i in range(30)).encode()
    bpe = train_bpe([text], 300, tmp_path / "bpe.json")
    assert bpe.vocab == 300
    ids = bpe.encode(text)
    assert ids.dtype == np.uint16 and len(ids) < len(text) / 1.5 and ids.max() < 300
    assert bpe.decode(ids) == text
    unseen = "zebra Ω 🙂\n\tx".encode()  # never in the training text: the byte alphabet still covers it
    again = BPE.load(tmp_path / "bpe.json")
    assert again.decode(again.encode(unseen)) == unseen
    np.testing.assert_array_equal(again.encode(text), ids)


def test_text_with_bpe_is_cached_and_counts_bits_per_byte(tmp_path):
    write_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    train, val = load_text(tmp_path / "corpus", context=16, cache_dir=cache, tokenizer="bpe:300")
    raw_train, raw_val, _ = split_corpus(*corpus_files(tmp_path / "corpus"))
    bpe = load_tokenizer(tmp_path / "corpus", "bpe:300", cache_dir=cache)
    assert train.num_classes == val.num_classes == bpe.vocab == 300 and train.info["tokenizer"] == "bpe:300"
    assert bpe.decode(train.tokens) == raw_train and bpe.decode(val.tokens) == raw_val
    assert bytes(np.asarray(val.text)) == raw_val  # the bigram baseline's bytes
    assert val.tokens_per_byte == pytest.approx(len(val.tokens) / len(raw_val)) and val.tokens_per_byte < 0.7
    again, _ = load_text(tmp_path / "corpus", context=16, cache_dir=cache, tokenizer="bpe:300")
    assert isinstance(again.tokens, np.memmap) and np.array_equal(np.asarray(again.tokens), np.asarray(train.tokens))
    # bits per byte: the mean loss per token (nats), over all tokens of the windows, x tokens / bytes
    torch.manual_seed(0)
    model = build_model("gpt", (16,), 300, width=16, depth=1, size="nano").eval()
    x, y = val.batch(torch.arange(len(val)))
    with torch.no_grad():
        nats_per_token = float(F.cross_entropy(model(x).reshape(-1, 300), y.reshape(-1)))
    measured = build_task("lm").evaluate(model, val, torch.device("cpu"))
    assert measured["test_loss"] == pytest.approx(nats_per_token, rel=1e-5)
    expected = nats_per_token * len(val.tokens) / len(raw_val) / math.log(2)
    assert measured["test_bpb"] == pytest.approx(expected, rel=1e-5)
    # byte-level tokens: one token a byte, the same formula
    byte_train, byte_val = load_text(tmp_path / "corpus", context=16, cache_dir=cache)
    assert byte_val.tokens_per_byte == 1.0 and byte_val.num_classes == 256
    model = build_model("gpt", (16,), 256, width=16, depth=1, size="nano").eval()
    x, y = byte_val.batch(torch.arange(len(byte_val)))
    with torch.no_grad():
        nats = float(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)))
    assert build_task("lm").evaluate(model, byte_val, torch.device("cpu"))["test_bpb"] == pytest.approx(
        nats / math.log(2), rel=1e-5)


def test_sample_decodes_with_the_runs_bpe(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus")
    monkeypatch.setenv("DISTRAIN_CACHE", str(tmp_path / "cache"))
    train, _ = load_text(tmp_path / "corpus", context=16, tokenizer="bpe:300")  # as the run did
    run = tmp_path / "run"
    run.mkdir()
    cfg = TrainConfig.from_dict({"model": "gpt", "dataset": "text", "tokenizer": "bpe:300", "context": 16,
                                 "model_width": 16, "model_depth": 1, "data_path": str(tmp_path / "corpus")})
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.manual_seed(0)
    model = build_model("gpt", (16,), train.num_classes, width=16, depth=1, size="nano")
    torch.save(model.state_dict(), run / "model.pt")
    bpe = load_tokenizer(tmp_path / "corpus", "bpe:300")
    prompt = "def area("
    start = torch.tensor([bpe.encode(prompt.encode()).tolist()], dtype=torch.int64)
    expected = bpe.decode(model.generate(start, 12, temperature=0)[0].tolist()).decode("utf-8", errors="replace")
    assert sample_text(run, prompt, tokens=12, temperature=0) == expected
    assert expected.startswith(prompt) and len(expected) > len(prompt)  # a model of 300 tokens loaded and ran
