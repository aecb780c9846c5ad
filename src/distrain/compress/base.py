"""The Compressor interface: a tensor becomes a payload (what goes on the wire) and back.

A payload is a list of tensors and nothing else: no pickled objects ever cross the network. The
context (``ctx``) stays on the worker and holds only what every worker can rebuild by itself
(shape, dtype, indices drawn from a shared seed), so ``decompress`` may be applied to a peer's
payload or to the sum of everybody's payloads, not only to the worker's own.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import torch

Payload = list[torch.Tensor]


@dataclass
class CompressInfo:
    """What a compressor may need to know about the tensor it is given.

    Args:
        step: the training step; seeds per-step randomness, so a resumed run draws the same.
        key: which tensor this is (a bucket or shard index); keys error-feedback memory and seeds.
        ratio: kept fraction for this call only, overriding the compressor's own ratio
            (density warm-up, adaptive compression); ignored by compressors without a ratio.
        worker: the calling worker's rank; decorrelates stochastic rounding across workers.
    """

    step: int = 0
    key: int = 0
    ratio: float | None = None
    worker: int = 0


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of the tensor that was compressed: the minimal decompression context."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tensor.shape, tensor.dtype, tensor.device)


class Compressor:
    """Turns a tensor into a payload and back.

    Subclasses set:

    * ``name``: the registry name (``--compress NAME:...``);
    * ``summable``: payloads of different workers can be summed element-wise in place, so an
      all-reduce of the payload tensors gives the payload of the sum (fp16, random-k with a
      shared seed); otherwise payloads are gathered, or, when ``sparse``, reduced by a sparse ring;
    * ``sparse``: the payload is ``[indices (int64), values]`` of the flattened tensor;
    * ``lossy``: whether error feedback has anything to feed back;
    * ``keeps_values``: the payload is ``[indices, values]`` with ``values`` the input's own
      elements at ``indices`` (top-k, group top-k), so what was not sent is the input with those
      elements zeroed and error feedback needs no decompression;
    * ``residual_decay``: error feedback multiplies the residual by it before adding the next
      tensor (1: nothing fades; SparseLoCo's ``decay=D`` is below 1).
    """

    name: str = "base"
    summable: bool = False
    sparse: bool = False
    lossy: bool = True
    keeps_values: bool = False
    residual_decay: float = 1.0
    #: the kept fraction for compressors that sparsify; None for the others
    ratio: float | None = None

    def compress(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, Any]:
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    def wire_bytes(self, numel: int, ratio: float | None = None, element_size: int = 4) -> int:
        """Bytes of the payload for a tensor of ``numel`` elements of ``element_size`` bytes."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()})"

    def spec(self) -> str:
        """The ``--compress`` spec that builds this compressor."""
        return self.name


def payload_nbytes(payload: Payload) -> int:
    """Bytes the payload's tensors occupy."""
    return sum(t.numel() * t.element_size() for t in payload)


def kept(ratio: float, size: int) -> int:
    """Elements kept out of ``size`` at ``ratio``: ``round(ratio * size)``, at least 1 (0 if empty)."""
    if size == 0:
        return 0
    return min(size, max(1, round(ratio * size)))


def check_ratio(ratio: float) -> float:
    """Return ``ratio`` as a float, or raise ValueError unless 0 < ratio <= 1."""
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0):  # also rejects NaN
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    return ratio


def derived_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (e.g. run seed, step, key): same on every worker."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator seeded from ``parts`` (see :func:`derived_seed`)."""
    return torch.Generator(device=device).manual_seed(derived_seed(*parts))


def desparsify(indices: torch.Tensor, values: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """Dense tensor of ``meta``'s shape: ``values`` at ``indices`` of the flattened tensor, 0 elsewhere.

    Repeated indices are summed, so the concatenation of several payloads desparsifies to their sum.
    """
    flat = torch.zeros(meta.numel, dtype=meta.dtype, device=meta.device)
    flat.index_add_(0, indices, values.to(meta.dtype))
    return flat.view(meta.shape)


class SparseCompressor(Compressor):
    """Base for compressors whose payload is ``[indices, values]`` of the flattened tensor."""

    sparse = True
    keeps_values = True  # subclasses that scale or round the values must set it False

    def __init__(self, ratio: float) -> None:
        self.ratio = check_ratio(ratio)

    def select(self, flat: torch.Tensor, ratio: float, info: CompressInfo) -> torch.Tensor:
        """Indices (int64) of the elements of the 1-D ``flat`` to keep."""
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, TensorMeta]:
        flat = tensor.reshape(-1)
        ratio = self.ratio if info.ratio is None else check_ratio(info.ratio)
        indices = self.select(flat, ratio, info)
        return [indices, flat[indices]], TensorMeta.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorMeta) -> torch.Tensor:
        indices, values = payload
        return desparsify(indices, values, ctx)

    def kept_count(self, numel: int, ratio: float | None = None) -> int:
        return kept(self.ratio if ratio is None else ratio, numel)

    def wire_bytes(self, numel: int, ratio: float | None = None, element_size: int = 4) -> int:
        return self.kept_count(numel, ratio) * (8 + element_size)

    def spec(self) -> str:
        return f"{self.name}:{self.ratio:g}"
