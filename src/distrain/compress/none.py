"""The identity compressor: the dense tensor is the payload."""

from __future__ import annotations

import torch

from distrain.compress.base import CompressInfo, Compressor, Payload, TensorMeta


class NoneCompressor(Compressor):
    """Send the tensor as it is (the payload may be reduced in place)."""

    name = "none"
    summable = True
    lossy = False

    def compress(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, TensorMeta]:
        return [tensor.reshape(-1)], TensorMeta.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorMeta) -> torch.Tensor:
        return payload[0].view(ctx.shape)

    def wire_bytes(self, numel: int, ratio: float | None = None, element_size: int = 4) -> int:
        return numel * element_size
