"""A user's own loop on the GPU through distrain.wrap(), as test_cuda.py runs it.

python cuda_script.py ALGORITHM SETTINGS_JSON [DEVICE [OUT]]

SGD for ``steps`` steps (a setting of its own, default 3; the others are wrap()'s), worker r taking
rows (s * W + r) * B .. + B at step s, the model and the data on DEVICE (default cuda). Every rank
prints the largest difference between its final model and one process trained on the concatenated
batches, and the mean loss over all the rows before and after; with OUT, it saves its final
parameters there (``rank{r}.pt``, on the CPU), so that a run on the CPU and one on the GPU can be
compared.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import distrain

B = 8


def make_model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)).to(device)


def data(n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    return x.to(device), ((x[:, 0] > 0).long() + (x[:, 1] > 0).long()).to(device)


algorithm, settings = sys.argv[1], json.loads(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
out = Path(sys.argv[4]) if len(sys.argv) > 4 else None
steps = settings.pop("steps", 3)
model = make_model(device)
opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm=algorithm, **settings)
W, r = opt.workers, opt.rank
x, y = data(steps * W * B, device)
with torch.no_grad():
    before = F.cross_entropy(model(x), y).item()
for s in range(steps):
    rows = slice((s * W + r) * B, (s * W + r + 1) * B)
    F.cross_entropy(model(x[rows]), y[rows]).backward()
    opt.step()
    opt.zero_grad()
final = opt.finish()
with torch.no_grad():
    after = F.cross_entropy(final(x), y).item()
ref = make_model(device)
one = torch.optim.SGD(ref.parameters(), lr=0.1)
for s in range(steps):
    rows = slice(s * W * B, (s + 1) * W * B)
    F.cross_entropy(ref(x[rows]), y[rows]).backward()
    one.step()
    one.zero_grad()
diff = max((a - b).abs().max().item() for a, b in zip(final.parameters(), ref.parameters(), strict=True))
if out is not None:
    torch.save([p.detach().cpu() for p in final.parameters()], out / f"rank{r}.pt")
print(f"rank {r} of {W}: {next(final.parameters()).device.type} difference {diff:.3e} loss {before:.6f} -> {after:.6f}",
      flush=True)
