"""Text for language models, with no download: byte-level tokens of a local corpus.

Without a path the corpus is the Python standard library's own source files of the running
interpreter (about 12 MB; test directories and installed packages left out), in sorted order.
A path names a text file or a directory of text files (every regular file under it, sorted).
Every 20th file, in that order, is held out for validation (by whole files, so no window of the
training set sees a validation file); a single file holds out its last 5%, cut at a line end.

Tokens are the bytes themselves (a vocabulary of 256), or with ``tokenizer="bpe:N"`` the ids of a
byte-level BPE of ``N`` tokens trained on the training split (:mod:`distrain.data.tokenizer`).
Both are cached as ``.npy`` arrays (memory-mapped when read back) under the data cache
(``$DISTRAIN_CACHE`` or ``~/.cache/distrain``), named by the corpus's SHA-256 (and ``N``).
Each split knows its ``tokens_per_byte``, so that a loss per token converts to bits per byte.

A sample is a window of ``context + 1`` tokens: the input is its first ``context`` tokens, the
target the ``context`` tokens after each. Windows do not overlap, and never cross from one split
into the other.

Example::

    train, val = load_text(context=128)
    x, y = train.batch(torch.tensor([0, 5]))      # int64 [2, 128] each; y is x shifted by one
"""

from __future__ import annotations

import hashlib
import io
import os
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from distrain.data.tokenizer import BPE, TokenizerSpec, parse_tokenizer, train_bpe
from distrain.errors import ConfigError, DataError
from distrain.runtime.files import atomic_write, exclusive_lock

#: Byte-level tokens.
VOCAB = 256
#: Every VAL_EVERY-th file (the last of each run of VAL_EVERY, in sorted order) is validation.
VAL_EVERY = 20
#: Directories of the standard library left out of the default corpus.
SKIPPED = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


class TextWindows(Dataset):
    """Non-overlapping windows over a token array: item ``i`` is ``(tokens[i*C : i*C+C],
    tokens[i*C+1 : i*C+C+1])`` for context ``C``.

    ``text`` is the split's bytes (the tokens themselves for byte-level tokens): bits per byte
    divide by its length, and the bigram baseline reads it.
    """

    def __init__(self, tokens: np.ndarray, context: int, info: dict[str, Any] | None = None, *,
                 vocab: int = VOCAB, text: np.ndarray | None = None) -> None:
        if context < 1:
            raise ConfigError("--context", f"must be an integer >= 1, got {context!r}")
        self.tokens, self.context = tokens, int(context)
        self.num_classes = int(vocab)
        self.text = tokens if text is None else text
        self.tokens_per_byte = len(tokens) / max(len(self.text), 1)
        self.info = dict(info or {})
        self._n = max(0, (len(tokens) - 1) // self.context)
        if self._n == 0:
            raise DataError(f"the text holds {len(tokens)} tokens, fewer than one window of {context + 1}")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.context,)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([int(i)]))
        return x[0], y[0]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows at ``indices`` as int64 ``(inputs, targets)`` of shape ``[len, context]``."""
        idx = np.asarray(torch.as_tensor(indices).reshape(-1), dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"window index out of range 0..{self._n - 1}")
        rows = np.asarray(self.tokens[(idx[:, None] * self.context + np.arange(self.context + 1))], dtype=np.int64)
        chunk = torch.from_numpy(rows)
        return chunk[:, :-1], chunk[:, 1:]


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's directory and its source files, sorted (no tests, no packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if p.is_file() and not SKIPPED & set(p.relative_to(root).parts))
    return root, files


def corpus_files(path: str | os.PathLike[str] | None) -> tuple[Path, list[Path]]:
    """The corpus's root and files: the standard library's sources, one file, or a directory's files."""
    if path is None:
        return stdlib_files()
    root = Path(path)
    if root.is_file():
        return root.parent, [root]
    if not root.is_dir():
        raise ConfigError("--data-path", f"{str(root)!r} is neither a text file nor a directory")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise DataError(f"{str(root)!r} holds no files")
    return root, files


def split_corpus(root: Path, files: list[Path]) -> tuple[bytes, bytes, dict[str, Any]]:
    """(training bytes, validation bytes, facts): by whole files, or a single file's last 5%."""
    digest = hashlib.sha256()
    train, val = io.BytesIO(), io.BytesIO()
    for i, f in enumerate(files):
        data = f.read_bytes()
        digest.update(str(f.relative_to(root)).encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        (val if len(files) > 1 and i % VAL_EVERY == VAL_EVERY - 1 else train).write(data)
    train_bytes, val_bytes = train.getvalue(), val.getvalue()
    if len(files) == 1:  # one file: the validation text is its tail, from a line start
        cut = len(train_bytes) - len(train_bytes) // 20
        newline = train_bytes.rfind(b"\n", 0, cut)
        cut = newline + 1 if newline > 0 else cut
        train_bytes, val_bytes = train_bytes[:cut], train_bytes[cut:]
    info = {"files": len(files), "val_files": len(files) // VAL_EVERY if len(files) > 1 else 0,
            "bytes": len(train_bytes) + len(val_bytes), "train_bytes": len(train_bytes), "val_bytes": len(val_bytes),
            "sha256": digest.hexdigest(), "corpus": "python-stdlib" if root == Path(sysconfig.get_paths()["stdlib"]) else "user"}
    return train_bytes, val_bytes, info


def _cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("DISTRAIN_CACHE") or Path.home() / ".cache" / "distrain")


def _cached(path: Path, make: Any) -> np.ndarray:
    if not path.exists():
        array = make()
        buffer = io.BytesIO()
        np.save(buffer, array)
        atomic_write(path, buffer.getvalue())
    return np.load(path, mmap_mode="r")


def load_text(path: str | os.PathLike[str] | None = None, *, context: int = 128,
              cache_dir: str | os.PathLike[str] | None = None,
              tokenizer: str = "bytes") -> tuple[TextWindows, TextWindows]:
    """The corpus's ``(train, validation)`` windows of ``context`` tokens (see the module);
    ``tokenizer`` is ``bytes`` or ``bpe:N``."""
    spec = parse_tokenizer(tokenizer)
    root, files = corpus_files(path)
    train_bytes, val_bytes, info = split_corpus(root, files)
    if not val_bytes:
        raise DataError("the text corpus left nothing for validation; give more text or more files")
    base = _base(cache_dir, info)
    train = _cached(base.with_name(base.name + "-train.npy"), lambda: np.frombuffer(train_bytes, dtype=np.uint8))
    val = _cached(base.with_name(base.name + "-val.npy"), lambda: np.frombuffer(val_bytes, dtype=np.uint8))
    if spec.kind == "bytes":
        train_tokens, val_tokens, vocab = train, val, VOCAB
    else:
        bpe = _bpe(base, spec, train_bytes)
        name = f"{base.name}-bpe{spec.vocab}"
        train_tokens = _cached(base.with_name(name + "-train.npy"), lambda: bpe.encode(train_bytes))
        val_tokens = _cached(base.with_name(name + "-val.npy"), lambda: bpe.encode(val_bytes))
        vocab = bpe.vocab
    info.update(tokenizer=str(spec), vocab=vocab, train_tokens=len(train_tokens), val_tokens=len(val_tokens))
    return (TextWindows(train_tokens, context, info, vocab=vocab, text=train),
            TextWindows(val_tokens, context, info, vocab=vocab, text=val))


def load_tokenizer(path: str | os.PathLike[str] | None = None, tokenizer: str = "bytes", *,
                   cache_dir: str | os.PathLike[str] | None = None) -> BPE | None:
    """The BPE a run with ``--tokenizer bpe:N`` on this corpus trained (from the cache, or trained
    again the same way); None for byte-level tokens."""
    spec = parse_tokenizer(tokenizer)
    if spec.kind == "bytes":
        return None
    train_bytes, _, info = split_corpus(*corpus_files(path))
    return _bpe(_base(cache_dir, info), spec, train_bytes)


def _base(cache_dir: str | os.PathLike[str] | None, info: dict[str, Any]) -> Path:
    return _cache_dir(cache_dir) / f"text-{info['sha256'][:16]}"


def _bpe(base: Path, spec: TokenizerSpec, train_bytes: bytes) -> BPE:
    """The corpus's BPE of ``spec.vocab`` tokens: from the cache, else trained on the training
    bytes under a lock (concurrent runs train it once)."""
    path = base.with_name(f"{base.name}-bpe{spec.vocab}.json")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(path.with_name(path.name + ".lock")):
            if not path.exists():
                return train_bpe([train_bytes], spec.vocab, path)
    return BPE.load(path)


def bigram_bpb(train: np.ndarray, val: np.ndarray) -> float:
    """Validation bits per byte of a bigram model fit on the training bytes (add-one smoothing):
    the floor a language model of this text must beat, whatever its tokenizer (it reads the
    splits' bytes, :attr:`TextWindows.text`)."""
    train, val = np.asarray(train, dtype=np.int64), np.asarray(val, dtype=np.int64)
    counts = np.bincount(train[:-1] * VOCAB + train[1:], minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB) + 1.0
    log_p = np.log2(counts / counts.sum(1, keepdims=True))
    return float(-log_p[val[:-1], val[1:]].mean())
