"""SparseLoCo: chunked top-k whose kept values are quantized to a few bits and bit-packed.

After Sarfi et al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo", which sends
DiLoCo's pseudo-gradients at 1-3% density with 2-bit values (``--compress
sparseloco:RATIO[:bits=B][:chunk=N][:decay=D]``):

* **chunked top-k**: the flattened tensor is cut into chunks of N consecutive elements (4096 by
  default; the last one may be shorter); each chunk keeps its k = round(RATIO * size), at least 1,
  largest magnitudes, as group top-k does;
* **quantized values**: a kept value becomes B bits (2 by default): its sign, and in B - 1 bits
  its magnitude's bin among L = 2^(B-1) equal bins spanning ``[lo, hi]``, the smallest and largest
  kept magnitude of its chunk; it decodes to the bin's centre, ``lo + (m + 1/2) (hi - lo) / L``.
  A kept value is therefore off by at most ``(hi - lo) / (2 L)`` (a quarter of its chunk's kept
  range at 2 bits; exact where a chunk's kept magnitudes are equal);
* **error feedback** (``--error-feedback on``, the default) keeps what quantization and
  sparsification dropped; ``decay=D`` in (0, 1] (1 by default) multiplies that residual by D
  before the next tensor is added, ``e <- D e + delta``, as SparseLoCo does. The paper lets the
  decaying residual take the place of the outer momentum, with a plain outer step
  (``--outer-optimizer sgd --outer-momentum 0 --outer-lr 1``).

The payload is two tensors, every byte of them needed:

* ``entries`` (uint8): for every kept element, chunk by chunk, its index inside its chunk
  (w = bit length of ``min(N, numel) - 1`` bits: 12 for chunks of 4096) followed by its B-bit code
  (sign bit highest), packed back to back, least significant bit first: ``ceil(K (w + B) / 8)``
  bytes for K kept elements;
* ``ranges`` (float32): ``lo`` and ``hi`` of every chunk, 8 bytes a chunk.

For 1,000,000 elements at RATIO 0.02 with the defaults: 244 full chunks keep 82 each and the last
(576 elements) 12, K = 20,020 entries of 14 bits (35,035 bytes) and 245 ranges (1,960 bytes):
36,995 bytes, 0.92% of the 4,000,000 of float32 (group top-k at the same ratio sends 240,240).
Payloads are not summable: they are gathered and each is decoded (every worker's has the same
size when they share the ratio).

Example::

    c = SparseLoCo(0.02, bits=2, chunk=4096)
    payload, ctx = c.compress(delta, CompressInfo())
    y = c.decompress(payload, ctx)        # the top 2% of each chunk, each within (hi - lo) / 4
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from distrain.compress.base import CompressInfo, Compressor, Payload, TensorMeta, check_ratio, kept

DEFAULT_CHUNK = 4096
"""Elements per chunk unless ``chunk=N`` says otherwise (the paper's chunk size)."""

MAX_CHUNK = 2**24
"""The largest chunk: an entry (index and code) must fit 32 bits."""


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """The low ``width`` bits of each integer of ``values`` back to back, least significant bit
    first, in ``ceil(len * width / 8)`` bytes (uint8; the last byte's spare bits are 0)."""
    count = values.numel()
    bits = torch.zeros(count, width, dtype=torch.uint8, device=values.device)
    for j in range(width):
        bits[:, j] = (values >> j) & 1
    stream = bits.reshape(-1)
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    octets = stream.view(-1, 8)
    packed = torch.zeros(octets.shape[0], dtype=torch.uint8, device=values.device)
    for j in range(8):
        packed |= octets[:, j] << j
    return packed


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` integers (int64) that :func:`pack_bits` packed at ``width`` bits each."""
    if packed.numel() != math.ceil(count * width / 8):
        raise ValueError(f"{packed.numel()} bytes cannot hold exactly {count} entries of {width} bits")
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * width].view(count, width)
    values = torch.zeros(count, dtype=torch.int64, device=packed.device)
    for j in range(width):
        values |= stream[:, j].to(torch.int64) << j
    return values


@dataclass(frozen=True)
class SparseLoCoContext:
    """What decoding needs besides the payload: the tensor's shape and the ratio it was sent at
    (which fixes every chunk's k; workers that share the ratio can decode each other's payloads)."""

    meta: TensorMeta
    ratio: float


class SparseLoCo(Compressor):
    """Chunked top-k with ``bits``-bit values (see the module docstring for the wire format).

    Args:
        ratio: kept fraction of every chunk, 0 < ratio <= 1 (the paper: 0.01 to 0.03).
        bits: bits per kept value, 1 to 8: the sign and ``bits - 1`` bits of magnitude level.
        chunk: elements per chunk, 2 to 2^24; the index of a kept element takes the bit length
            of ``chunk - 1`` bits (12 at 4096).
        decay: error feedback's residual decay D in (0, 1]: ``e <- D e + delta``.

    Example::

        >>> c = SparseLoCo(0.5, bits=2, chunk=4)
        >>> payload, ctx = c.compress(torch.tensor([4.0, -1.0, 0.5, -2.0]), CompressInfo())
        >>> c.decompress(payload, ctx)
        tensor([ 3.5000,  0.0000,  0.0000, -2.5000])
    """

    name = "sparseloco"
    summable = False
    sparse = False
    lossy = True

    def __init__(self, ratio: float, bits: int = 2, chunk: int = DEFAULT_CHUNK, decay: float = 1.0) -> None:
        self.ratio = check_ratio(ratio)
        if isinstance(bits, bool) or int(bits) != bits or not 1 <= bits <= 8:
            raise ValueError(f"bits must be an integer from 1 to 8, got {bits!r}")
        if isinstance(chunk, bool) or int(chunk) != chunk or not 2 <= chunk <= MAX_CHUNK:
            raise ValueError(f"chunk must be an integer from 2 to {MAX_CHUNK}, got {chunk!r}")
        decay = float(decay)
        if not 0.0 < decay <= 1.0:  # also rejects NaN
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.bits, self.chunk, self.residual_decay = int(bits), int(chunk), decay
        self.levels = 2 ** (self.bits - 1)  # magnitude bins

    def _blocks(self, numel: int) -> Iterator[tuple[int, int, int]]:
        """(first element, chunks, chunk size) of the full chunks, then of the shorter last one."""
        full, tail = divmod(numel, self.chunk)
        if full:
            yield 0, full, self.chunk
        if tail:
            yield full * self.chunk, 1, tail

    def _width(self, numel: int) -> int:
        """Bits of one entry: the index inside its chunk, then the code."""
        return (min(self.chunk, numel) - 1).bit_length() + self.bits if numel else self.bits

    def compress(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, SparseLoCoContext]:
        ratio = self.ratio if info.ratio is None else check_ratio(info.ratio)
        flat = tensor.detach().reshape(-1).float()
        entries, ranges = [], []
        for start, rows, size in self._blocks(flat.numel()):
            view = flat[start : start + rows * size].view(rows, size)
            k = kept(ratio, size)
            magnitude = view.abs()
            if k == size:
                local = torch.arange(size, device=flat.device).expand(rows, size)
            else:
                magnitude, local = magnitude.topk(k, dim=1, sorted=False)
            negative = view.gather(1, local) < 0
            lo, hi = magnitude.amin(1, keepdim=True), magnitude.amax(1, keepdim=True)
            step = (hi - lo) / self.levels
            safe = torch.where(step > 0, step, torch.ones_like(step))
            level = ((magnitude - lo) / safe).floor_().clamp_(0, self.levels - 1).to(torch.int64)
            code = (negative.to(torch.int64) << (self.bits - 1)) | level
            entries.append(((local << self.bits) | code).reshape(-1))
            ranges.append(torch.cat([lo, hi], 1).reshape(-1))
        meta = TensorMeta.of(tensor)
        values = torch.cat(entries) if entries else torch.zeros(0, dtype=torch.int64, device=flat.device)
        scales = torch.cat(ranges) if ranges else flat.new_zeros(0)
        return [pack_bits(values, self._width(flat.numel())), scales], SparseLoCoContext(meta, ratio)

    def decompress(self, payload: Payload, ctx: SparseLoCoContext) -> torch.Tensor:
        packed, scales = payload
        meta, numel = ctx.meta, ctx.meta.numel
        out = torch.zeros(numel, dtype=torch.float32, device=packed.device)
        counts = [(start, rows, size, kept(ctx.ratio, size)) for start, rows, size in self._blocks(numel)]
        total = sum(rows * k for _, rows, _, k in counts)
        if total:
            values = unpack_bits(packed, self._width(numel), total)
            local, code = values >> self.bits, values & ((1 << self.bits) - 1)
            chunk_of = torch.cat([torch.arange(rows, device=packed.device).repeat_interleave(k) + start // self.chunk
                                  for start, rows, _, k in counts])
            lo, hi = scales.view(-1, 2)[chunk_of].float().unbind(1)
            level = (code & (self.levels - 1)).float()
            magnitude = lo + (level + 0.5) * ((hi - lo) / self.levels)
            out[chunk_of * self.chunk + local] = torch.where(code >> (self.bits - 1) == 1, -magnitude, magnitude)
        return out.to(meta.device, meta.dtype).view(meta.shape)

    def kept_count(self, numel: int, ratio: float | None = None) -> int:
        ratio = self.ratio if ratio is None else ratio
        return sum(rows * kept(ratio, size) for _, rows, size in self._blocks(numel))

    def wire_bytes(self, numel: int, ratio: float | None = None, element_size: int = 4) -> int:
        chunks = sum(rows for _, rows, _ in self._blocks(numel))
        return math.ceil(self.kept_count(numel, ratio) * self._width(numel) / 8) + 8 * chunks

    def spec(self) -> str:
        text = f"{self.name}:{self.ratio:g}"
        if self.bits != 2:
            text += f":bits={self.bits}"
        if self.chunk != DEFAULT_CHUNK:
            text += f":chunk={self.chunk}"
        if self.residual_decay != 1.0:
            text += f":decay={self.residual_decay:g}"
        return text
