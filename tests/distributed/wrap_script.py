"""A user's own training script, as the wrap() tests run it (through distrain launch or torchrun).

python wrap_script.py ALGORITHM MODE OUT_DIR [SETTINGS_JSON]

MODE sync: 3 steps of SGD (lr 0.1, a StepLR scheduler, zero_grad(set_to_none=True)), worker r
taking rows (s * W + r) * B .. + B at step s; saves the model to OUT_DIR/rank<r>.pt.
MODE lm: as sync, on a small GPT and random token windows (per-token cross-entropy).
MODE groups: as sync, in two groups of half the processes each (``process_group=``; the script
opens the default group itself), group g on data of seed 1 + g; saves to OUT_DIR/rank<global rank>.pt.
MODE groups-mean: as groups, with the models moved by + global rank after wrapping, at lr 0.
MODE mean: models made different per worker after wrapping (+ rank), 3 steps at lr 0; saves them.
MODE async: trains its shard until keep_going() says stop; saves steps and the consensus accuracy.
MODE full / first / second: 6 steps of momentum SGD; all of them, the first 3 then a checkpoint
(model and opt.state_dict() per rank), or the last 3 from that checkpoint; saves the model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import distrain

BATCH = 8
FEATURES, CLASSES = 8, 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))


def make_gpt() -> torch.nn.Module:
    from distrain.models.gpt import GPT

    torch.manual_seed(0)
    return GPT((16,), 256, width=32, depth=2)


def make_tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(256, (n, 17), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def make_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def main() -> None:
    algorithm, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    settings = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    model = make_gpt() if mode == "lm" else make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.0 if mode in ("mean", "groups-mean") else 0.1)
    group, seed, name, offset = None, 1, None, None
    if mode in ("groups", "groups-mean"):  # the user's own default group, split in halves; each half trains apart
        import torch.distributed as dist

        dist.init_process_group("gloo")
        half = dist.get_world_size() // 2
        groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, 2 * half)))]
        seed, name = 1 + dist.get_rank() // half, f"rank{dist.get_rank()}.pt"
        group = groups[dist.get_rank() // half]
        offset = dist.get_rank() if mode == "groups-mean" else None
    opt = distrain.wrap(model, inner, algorithm=algorithm, process_group=group, **settings)
    rank, workers = opt.rank, opt.workers
    if mode == "mean":
        offset = rank
    if mode in ("sync", "lm", "mean", "groups", "groups-mean"):
        scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5) if mode in ("sync", "groups") else None
        if offset is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(offset))
        x, y = make_tokens(3 * workers * BATCH) if mode == "lm" else make_data(3 * workers * BATCH, seed)
        for step in range(3):
            rows = slice((step * workers + rank) * BATCH, (step * workers + rank + 1) * BATCH)
            out_rows = model(x[rows])
            torch.nn.functional.cross_entropy(out_rows.reshape(-1, out_rows.shape[-1]), y[rows].reshape(-1)).backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            opt.zero_grad()
        torch.save(model.state_dict(), out / (name or f"rank{rank}.pt"))
        opt.finish()
        if group is not None:
            dist.destroy_process_group()
    elif mode in ("full", "first", "second"):
        inner.param_groups[0]["momentum"] = 0.9
        x, y = make_data(6 * workers * BATCH)
        steps = {"full": range(6), "first": range(3), "second": range(3, 6)}[mode]
        if mode == "second":
            state = torch.load(out / f"checkpoint{rank}.pt", weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        for step in steps:
            rows = slice((step * workers + rank) * BATCH, (step * workers + rank + 1) * BATCH)
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad()
        if mode == "first":
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out / f"checkpoint{rank}.pt")
        torch.save(model.state_dict(), out / f"{mode}{rank}.pt")
        opt.finish()
    else:
        x, y = make_data(4000)
        shard = opt.shard(torch.utils.data.TensorDataset(x[:3200], y[:3200]))
        order = torch.Generator().manual_seed(rank)
        while opt.keep_going():
            idx = torch.randint(len(shard), (BATCH,), generator=order)
            xb, yb = shard[idx.tolist()]
            losses = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
            losses.mean().backward()
            opt.step(losses=losses)
            opt.zero_grad()
        final = opt.finish()
        with torch.no_grad():
            accuracy = (final(x[3200:]).argmax(1) == y[3200:]).float().mean().item()
        (out / f"rank{rank}.json").write_text(json.dumps({"steps": opt.steps, "accuracy": accuracy}))


if __name__ == "__main__":
    main()
