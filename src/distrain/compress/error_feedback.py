"""Error feedback (residual memory): what compression dropped is added back before the next step.

Compressed SGD with error feedback converges like SGD (Stich et al. 2018, Karimireddy et al.
2019): each step compresses ``g + e`` instead of ``g`` and keeps ``e <- (g + e) - C(g + e)``, so
nothing is lost, only delayed; every coordinate is eventually sent.

A compressor may ask for the residual to decay (``residual_decay`` D < 1, e.g. ``sparseloco``'s
``decay=D``): each step then compresses ``g + D e``, so old, unsent mass fades rather than waiting
for its turn (SparseLoCo, Sarfi et al. 2025, where the decaying residual stands in for DiLoCo's outer
momentum).

With ``residual_device="cpu"`` (DiLoCo's pseudo-gradients) the residuals are kept in CPU memory
whatever the tensor's device (a model-sized buffer per key that a GPU need not hold); each sync
moves the one in use to the tensor's device and back. By default each stays on its tensor's
device, as a gradient compressed at every step wants.
"""

from __future__ import annotations

from typing import Any

import torch

from distrain.compress.base import CompressInfo, Compressor, Payload


class ErrorFeedback(Compressor):
    """Wrap any compressor with residual memory, one residual per tensor key.

    Args:
        compressor: the compressor to wrap; its payloads, collective kind and wire size are kept;
            its ``residual_decay`` (1 for all but a few) scales the residual before it is added.
        residual_device: where the residuals live (e.g. "cpu"); None keeps each on its tensor's device.

    Example::

        ef = ErrorFeedback(GroupTopK(0.01))
        payload, ctx = ef.compress(grad, CompressInfo(step=step, key=0))
        # ... exchange payload ...
        torch.save(ef.state_dict(), "ef.pt")   # tensors only
    """

    def __init__(self, compressor: Compressor, residual_device: torch.device | str | None = None) -> None:
        if isinstance(compressor, ErrorFeedback):
            raise ValueError("compressor already has error feedback")
        self.inner = compressor
        self.name = compressor.name
        self.summable, self.sparse, self.lossy = compressor.summable, compressor.sparse, compressor.lossy
        self.decay = float(compressor.residual_decay)
        self.residual_device = None if residual_device is None else torch.device(residual_device)
        self.residuals: dict[int, torch.Tensor] = {}

    @property
    def ratio(self) -> float | None:  # type: ignore[override]
        return self.inner.ratio

    def compensate(self, tensor: torch.Tensor, key: int) -> torch.Tensor:
        """``tensor`` plus the (decayed) residual kept for ``key``, on ``tensor``'s device (a new
        tensor; the input is untouched)."""
        residual = self.residuals.get(key)
        if residual is None or residual.shape != tensor.shape:
            return tensor.clone()
        residual = residual.to(tensor.device)
        return tensor + residual if self.decay == 1.0 else torch.add(tensor, residual, alpha=self.decay)

    def _keep(self, key: int, residual: torch.Tensor) -> None:
        """Store ``residual`` for ``key`` on the residual device, into the old buffer if it fits."""
        device = self.residual_device
        if device is None or residual.device == device:
            self.residuals[key] = residual
            return
        old = self.residuals.get(key)
        if old is not None and (old.shape, old.dtype, old.device) == (residual.shape, residual.dtype, device):
            self.residuals[key] = old.copy_(residual)
        else:
            self.residuals[key] = residual.to(device)

    def compress(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, Any]:
        if self.inner.keeps_values:
            return self._compress_kept(tensor, info)
        compensated = self.compensate(tensor, info.key)
        payload, ctx = self.inner.compress(compensated, info)
        # Taken now, before the payload is handed to a collective that may reduce it in place;
        # out of place, because a payload may be a view of ``compensated`` (the identity).
        sent = self.inner.decompress(payload, ctx)
        residual = compensated - sent
        self.after_send(sent.reshape(-1).nonzero().squeeze(1), bool(residual.any()), info.key)
        self._keep(info.key, residual)
        return payload, ctx

    def _compress_kept(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, Any]:
        """The same for sparsifiers that send the input's own values: the residual becomes the
        compensated tensor, in place, with the sent elements zeroed (exactly ``compensated -
        sent``), so a step costs no dense decompression, subtraction or new residual tensor
        (where the residual lives on the tensor's device: on the CPU, for CPU tensors)."""
        residual = self.residuals.get(info.key)
        if residual is not None and (residual.shape, residual.dtype, residual.device) == (
                tensor.shape, tensor.dtype, tensor.device):
            if self.decay != 1.0:
                residual.mul_(self.decay)
            compensated = residual.add_(tensor)  # the same sum as tensor + residual, in place
        else:
            compensated = self.compensate(tensor, info.key).contiguous()
        payload, ctx = self.inner.compress(compensated, info)  # its values are copies
        indices = payload[0]
        compensated.view(-1).index_fill_(0, indices, 0.0)
        self.after_send(indices, indices.numel() < compensated.numel(), info.key)
        self._keep(info.key, compensated)
        return payload, ctx

    def after_send(self, indices: torch.Tensor, held_back: bool, key: int) -> None:
        """Called with the flat indices this worker sent and whether anything was held back (a
        nonzero residual); a hook for subclasses."""

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def wire_bytes(self, numel: int, ratio: float | None = None, element_size: int = 4) -> int:
        return self.inner.wire_bytes(numel, ratio, element_size)

    def reset(self) -> None:
        self.residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"residual.{key}": r for key, r in self.residuals.items()}
        state.update({f"inner.{k}": v for k, v in self.inner.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {int(k.split(".", 1)[1]): v.to(self.residual_device or v.device, copy=True)
                          for k, v in state.items() if k.startswith("residual.")}
        self.inner.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("inner.")})

    def spec(self) -> str:
        return self.inner.spec()

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"
