"""A decoder-only transformer (GPT) for language modelling over a small vocabulary.

Pre-LayerNorm blocks with causal self-attention (``torch.nn.functional.scaled_dot_product_attention``)
and a GELU MLP, learned position embeddings, input and output embeddings tied, GPT-2's
initialisation (normal, std 0.02; the projections that write into the residual stream scaled by
``1 / sqrt(2 * depth)``). The input is ``[batch, context]`` token ids, the output
``[batch, context, vocab]`` logits.

Sizes (``--model-size``; ``--model-width`` and ``--model-depth`` override), with a 256-token
vocabulary and a context of 128:

    nano     width 64,  depth 4,  4 heads     ~0.2M parameters
    micro    width 128, depth 5,  4 heads     ~1.0M
    small    width 256, depth 8,  8 heads     ~6.4M
    medium   width 512, depth 8,  8 heads     ~25M
    base     width 768, depth 12, 12 heads    ~85M

Example::

    model = GPT((128,), 256, size="micro")
    logits = model(torch.randint(256, (4, 128)))     # [4, 128, 256]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from distrain.errors import ConfigError
from distrain.models.zoo import _check_size

#: size -> (width, depth, heads)
GPT_SIZES: dict[str, tuple[int, int, int]] = {
    "nano": (64, 4, 4), "micro": (128, 5, 4), "small": (256, 8, 8), "medium": (512, 8, 8), "base": (768, 12, 12),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT for ``input_shape = (context,)`` and a vocabulary of ``num_classes`` tokens."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, width: int | None = None,
                 depth: int | None = None, size: str = "nano") -> None:
        super().__init__()
        if size not in GPT_SIZES:
            raise ConfigError("--model-size", f"must be one of {', '.join(GPT_SIZES)}, got {size!r}")
        if len(input_shape) != 1:
            raise ConfigError("--model", f"gpt takes sequences of token ids (input shape (context,)), got "
                                         f"{tuple(input_shape)}")
        base_width, base_depth, heads = GPT_SIZES[size]
        width = base_width if width is None else width
        depth = base_depth if depth is None else depth
        _check_size("--model-width", width)
        _check_size("--model-depth", depth)
        heads = next(h for h in range(min(heads, width), 0, -1) if width % h == 0)  # heads that divide the width
        self.context, self.vocab = int(input_shape[0]), int(num_classes)
        self.tokens = nn.Embedding(self.vocab, width)
        self.positions = nn.Embedding(self.context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, self.vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"a sequence of {t} tokens is longer than the context of {self.context}")
        h = self.tokens(idx) + self.positions(torch.arange(t, device=idx.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``idx`` followed by ``tokens`` sampled tokens (temperature 0: the most likely)."""
        for _ in range(tokens):
            logits = self(idx[:, -self.context:])[:, -1]
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=generator)
            idx = torch.cat([idx, nxt], 1)
        return idx
