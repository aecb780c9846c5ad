"""The GPT language model and the lm task: causality, the loss at initialisation, learning."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.models import build_model
from distrain.models.gpt import GPT, GPT_SIZES
from distrain.tasks import build_task


def test_changing_a_token_leaves_the_logits_before_it_unchanged():
    torch.manual_seed(0)
    model = GPT((32,), 256, size="nano").eval()
    idx = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=0)
    assert not torch.allclose(a[:, 20:], b[:, 20:])  # from token 20 on, the change is seen


def test_loss_at_initialisation_is_that_of_a_uniform_guess():
    torch.manual_seed(0)
    model = GPT((64,), 256, size="micro")
    idx = torch.randint(256, (8, 65), generator=torch.Generator().manual_seed(2))
    loss = build_task("lm").losses(model(idx[:, :-1]), idx[:, 1:]).mean().item()
    assert abs(loss - math.log(256)) < 0.1, loss


def test_sizes_and_tied_embeddings():
    counts = {size: sum(p.numel() for p in GPT((128,), 256, size=size).parameters()) for size in GPT_SIZES}
    assert 0.15e6 < counts["nano"] < 0.3e6 and 0.8e6 < counts["micro"] < 1.2e6
    assert 5e6 < counts["small"] < 7e6 and 20e6 < counts["medium"] < 30e6 and 75e6 < counts["base"] < 95e6
    model = build_model("gpt", (16,), 256, width=48, depth=2, size="nano")
    assert model.head.weight is model.tokens.weight
    assert len(model.blocks) == 2 and model.tokens.weight.shape == (256, 48)


def test_one_process_overfits_a_small_text():
    text = (b"distrain trains language models over slow links. " * 20)[:1024]
    tokens = torch.tensor(list(text))
    context = 64
    windows = tokens[: (len(tokens) - 1) // context * context + 1]
    starts = torch.arange(0, len(windows) - context, context)
    x = torch.stack([windows[s : s + context] for s in starts])
    y = torch.stack([windows[s + 1 : s + context + 1] for s in starts])
    torch.manual_seed(0)
    model = GPT((context,), 256, size="nano")
    task = build_task("lm")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    while len(losses) < 300 and (not losses or losses[-1] >= 0.1):
        loss = task.losses(model(x), y).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1, (len(losses), losses[-1])


def test_the_lm_task_reports_bits_per_token():
    torch.manual_seed(0)
    model = GPT((8,), 256, width=16, depth=1)
    data = torch.utils.data.TensorDataset(torch.randint(256, (10, 8)), torch.randint(256, (10, 8)))
    metrics = build_task("lm").evaluate(model, data, torch.device("cpu"))
    assert set(metrics) == {"test_loss", "test_bpb"}
    assert metrics["test_bpb"] == pytest.approx(metrics["test_loss"] / math.log(2))
