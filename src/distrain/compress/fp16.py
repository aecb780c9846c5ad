"""Half precision: send the tensor as float16 (or bfloat16) and cast back."""

from __future__ import annotations

import torch

from distrain.compress.base import CompressInfo, Compressor, Payload, TensorMeta


class FP16Compressor(Compressor):
    """Cast to a 16-bit float type; payloads are summed in that type by the all-reduce.

    float16 keeps 11 significant bits but overflows above 65504; bfloat16 keeps only 8 but has
    float32's range. Either halves the bytes of a float32 gradient.

    Args:
        dtype: ``torch.float16`` (registered as ``fp16``) or ``torch.bfloat16`` (``bf16``).
    """

    summable = True

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def compress(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, TensorMeta]:
        return [tensor.reshape(-1).to(self.dtype)], TensorMeta.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorMeta) -> torch.Tensor:
        return payload[0].to(ctx.dtype).view(ctx.shape)

    def wire_bytes(self, numel: int, ratio: float | None = None, element_size: int = 4) -> int:
        return numel * 2
