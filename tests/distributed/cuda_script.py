"""A user's own loop on the GPU through distrain.wrap(), as test_cuda.py runs it.

python cuda_script.py ALGORITHM SETTINGS_JSON

3 steps of SGD, worker r taking rows (s * W + r) * B .. + B at step s; every rank prints the
largest difference between its final model and one process trained on the concatenated batches.
"""

import json
import sys

import torch
import torch.nn.functional as F

import distrain

B = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)).cuda()


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    return x.cuda(), ((x[:, 0] > 0).long() + (x[:, 1] > 0).long()).cuda()


algorithm, settings = sys.argv[1], json.loads(sys.argv[2])
model = make_model()
opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm=algorithm, **settings)
W, r = opt.workers, opt.rank
x, y = data(3 * W * B)
for s in range(3):
    rows = slice((s * W + r) * B, (s * W + r + 1) * B)
    F.cross_entropy(model(x[rows]), y[rows]).backward()
    opt.step()
    opt.zero_grad()
final = opt.finish()
ref = make_model()
one = torch.optim.SGD(ref.parameters(), lr=0.1)
for s in range(3):
    rows = slice(s * W * B, (s + 1) * W * B)
    F.cross_entropy(ref(x[rows]), y[rows]).backward()
    one.step()
    one.zero_grad()
diff = max((a - b).abs().max().item() for a, b in zip(final.parameters(), ref.parameters(), strict=True))
print(f"rank {r} of {W}: {next(final.parameters()).device.type} difference {diff:.3e}", flush=True)
