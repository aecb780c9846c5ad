"""Tokenizers of the text data set: the bytes themselves, or a byte-level BPE trained here.

``--tokenizer bytes`` (the default) keeps every byte as a token (a vocabulary of 256).
``--tokenizer bpe:N`` trains a byte-level BPE (GPT-2's scheme: every byte is a base token, so
any text encodes and decodes back exactly) with a vocabulary of ``N`` on the corpus's
*training* split only, with the ``tokenizers`` package (``pip install 'distrain[lm]'``). It is
cached beside the token arrays, named by the corpus's SHA-256 and ``N``, so every worker, a
resumed run and ``distrain sample`` find the same one.

BPE training sees text, not bytes: a corpus that is not valid UTF-8 has its bad bytes replaced
(U+FFFD) before training and encoding (bits per byte still divide by the split's own bytes).

Example::

    spec = parse_tokenizer("bpe:512")            # TokenizerSpec(kind="bpe", vocab=512)
    bpe = train_bpe([b"def f(x):\\n    return x\\n"] * 50, 300, path)
    assert bpe.decode(bpe.encode(b"def g(): pass")) == b"def g(): pass"
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distrain.errors import ConfigError
from distrain.runtime.files import atomic_write

#: Byte-level tokens: the vocabulary of ``--tokenizer bytes``.
BYTES_VOCAB = 256
#: The largest BPE vocabulary: token ids are stored as uint16.
MAX_VOCAB = 65536
#: Text is encoded in pieces of about this many characters, cut after a line end (in parallel).
PIECE = 1 << 16

SETTING = "--tokenizer"


@dataclass(frozen=True)
class TokenizerSpec:
    """A parsed ``--tokenizer``: ``bytes``, or ``bpe`` with its vocabulary size."""

    kind: str
    vocab: int = BYTES_VOCAB

    def __str__(self) -> str:
        return "bytes" if self.kind == "bytes" else f"bpe:{self.vocab}"


def parse_tokenizer(spec: str) -> TokenizerSpec:
    """``bytes`` or ``bpe:N`` (257 <= N <= 65536), else ConfigError naming ``--tokenizer``."""
    if spec == "bytes":
        return TokenizerSpec("bytes")
    match = re.fullmatch(r"bpe:(\d+)", spec.strip()) if isinstance(spec, str) else None
    if match is None or not BYTES_VOCAB < int(match.group(1)) <= MAX_VOCAB:
        raise ConfigError(SETTING, f"must be 'bytes' or 'bpe:N' with {BYTES_VOCAB} < N <= {MAX_VOCAB} (the BPE "
                                   f"vocabulary, the 256 bytes included), got {spec!r}")
    return TokenizerSpec("bpe", int(match.group(1)))


def require_tokenizers(spec: TokenizerSpec | str = "bpe:N") -> Any:
    """The ``tokenizers`` package, or MissingExtraError naming ``--tokenizer`` and the extra."""
    from distrain.extras import require

    return require("tokenizers", feature=f"{SETTING} {spec}", setting=SETTING)


def pieces(text: str, size: int = PIECE) -> Iterator[str]:
    """``text`` in consecutive pieces of about ``size`` characters, each cut after a line end."""
    i = 0
    while i < len(text):
        j = text.find("\n", i + size)
        j = len(text) if j < 0 else j + 1
        yield text[i:j]
        i = j


class BPE:
    """A trained byte-level BPE: bytes -> token ids -> bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab = int(tokenizer.get_vocab_size())

    @classmethod
    def load(cls, path: str | Path) -> BPE:
        return cls(require_tokenizers().Tokenizer.from_file(str(path)))

    def encode(self, data: bytes) -> np.ndarray:
        """The token ids of ``data`` as uint16 (invalid UTF-8 replaced first, see the module)."""
        text = data.decode("utf-8", errors="replace")
        encoded = self.tokenizer.encode_batch(list(pieces(text)))
        ids = [e.ids for e in encoded]
        return np.fromiter((i for row in ids for i in row), dtype=np.uint16, count=sum(map(len, ids)))

    def decode(self, ids: Iterable[int]) -> bytes:
        """The bytes of ``ids`` (a cut multi-byte character decodes as U+FFFD)."""
        return self.tokenizer.decode([int(i) for i in ids]).encode("utf-8")


def train_bpe(texts: Iterable[bytes], vocab: int, path: str | Path) -> BPE:
    """Train a byte-level BPE of ``vocab`` tokens on ``texts``, save it to ``path`` (atomically) and
    return it. The vocabulary may come out smaller when the text holds fewer distinct merges."""
    spec = TokenizerSpec("bpe", vocab)
    tk = require_tokenizers(spec)
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     special_tokens=[], show_progress=False)
    tokenizer.train_from_iterator((p for t in texts for p in pieces(t.decode("utf-8", errors="replace"))),
                                  trainer=trainer)
    atomic_write(Path(path), tokenizer.to_str().encode())
    return BPE(tokenizer)
