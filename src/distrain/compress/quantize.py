"""int8 and int4: per-block absmax quantization (``--compress int8[:block=N]``, ``int4[:block=N]``).

The flattened tensor is cut into blocks of ``block`` elements (64 by default; the last one padded
with zeros); each block is sent as its scale ``s = max |x| / q`` (float32, ``q`` = 127 for int8,
7 for int4) and its codes ``round(x / s)`` in ``[-q, q]`` (int8; int4 codes two to a byte). The
error of an element is at most ``s / 2``, i.e. half a quantization step of its block. Payloads
are not summable: a tensor of at least as many blocks as workers is summed by a ring that decodes,
adds and quantizes again at each hop (:func:`distrain.compress.collective.requantizing_ring`),
a smaller one gathered and summed after decoding. Lossy, so error feedback applies
(``--error-feedback on``, the default) to each worker's own quantization.

Payload bytes for ``n`` elements: ``n + 4 * ceil(n / block)`` (int8), ``ceil(n / 2) + 4 *
ceil(n / block)`` (int4): about 3.8x and 6.4x fewer than float32 at blocks of 64.

Example::

    q = BlockQuantizer(bits=4, block=64)
    payload, meta = q.compress(x, CompressInfo())
    y = q.decompress(payload, meta)            # |y - x| <= scale / 2 element-wise
"""

from __future__ import annotations

import math

import torch

from distrain.compress.base import CompressInfo, Compressor, Payload, TensorMeta

#: elements per block unless ``block=N`` says otherwise
DEFAULT_BLOCK = 64


class BlockQuantizer(Compressor):
    """Per-block absmax quantization to ``bits`` (8 or 4) bits per element."""

    summable = False
    lossy = True
    #: partial sums can be quantized again at each hop of a ring (compress/collective.py)
    requantizes = True

    def __init__(self, bits: int, block: int = DEFAULT_BLOCK) -> None:
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        if not isinstance(block, int) or isinstance(block, bool) or block < 2 or block % 2:
            raise ValueError(f"block must be an even integer >= 2, got {block!r}")
        self.bits, self.block = bits, block
        self.levels = 127 if bits == 8 else 7
        self.name = f"int{bits}"

    def compress(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, TensorMeta]:
        flat = tensor.detach().reshape(-1).float()
        n = flat.numel()
        blocks = max(1, math.ceil(n / self.block))
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=flat.device)
        padded[:n] = flat
        rows = padded.view(blocks, self.block)
        scales = rows.abs().amax(1) / self.levels
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(rows / safe[:, None]).clamp_(-self.levels, self.levels).to(torch.int8)
        if self.bits == 4:  # two codes a byte: (code + 8) in 1..15, low nibble first
            nibbles = (codes.view(-1) + 8).to(torch.uint8)
            codes = nibbles[0::2] | (nibbles[1::2] << 4)
        return [codes.reshape(-1), scales], TensorMeta.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorMeta) -> torch.Tensor:
        codes, scales = payload
        if self.bits == 4:
            low, high = (codes & 0x0F).to(torch.int8) - 8, (codes >> 4).to(torch.int8) - 8
            codes = torch.stack([low, high], 1).reshape(-1)
        values = codes.view(-1, self.block).float() * scales[:, None]
        return values.reshape(-1)[: ctx.numel].to(ctx.dtype).view(ctx.shape)

    def wire_bytes(self, numel: int, ratio: float | None = None, element_size: int = 4) -> int:
        blocks = max(1, math.ceil(numel / self.block))
        code_bytes = blocks * self.block if self.bits == 8 else blocks * self.block // 2
        return code_bytes + 4 * blocks

    def spec(self) -> str:
        return self.name if self.block == DEFAULT_BLOCK else f"{self.name}:block={self.block}"
