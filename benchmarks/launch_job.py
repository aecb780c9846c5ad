"""A short user's job for ``bench_launch.py``: what a rank's start and a restarted rank's join cost.

The MNIST-1D CNN through ``distrain.wrap(model, optimizer)`` (allreduce), SGD with momentum,
``STEPS`` steps of batch 32 per worker. Each rank appends its moments (Unix time) to
``OUT/rank<R>.json``: ``start`` as the script begins (before it imports torch), ``first_step``
after its first step, ``end`` after ``finish()``. With ``VICTIM >= 0`` that worker kills itself
(SIGKILL) as step ``AT`` begins in its first life (``killed``), and the others go on until it has
joined again (``distrain launch --max-restarts 1``) and 4 steps more; its new life records
``joined``, as ``wrap()`` returns with the members' state.

    distrain launch --workers 4 benchmarks/launch_job.py OUT STEPS VICTIM AT
"""

import time

START = time.time()

import json  # noqa: E402 - the script's start is taken before its imports
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import distrain  # noqa: E402
from distrain.data import load_dataset  # noqa: E402
from distrain.models import build_model  # noqa: E402


def main() -> None:
    out, steps, victim, at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    first_life = "DISTRAIN_JOIN" not in os.environ
    moments = {"start": START}
    torch.set_num_threads(1)
    train, _ = load_dataset("mnist1d", num_samples=4000, seed=0)
    torch.manual_seed(0)
    model = build_model("cnn1d", train.input_shape, train.num_classes)
    opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), algorithm="allreduce")
    if not first_life:
        moments["joined"] = time.time()
    me = opt.id
    path = out / f"rank{me}.json"
    if path.exists():  # a new life: keep what the first one recorded
        moments = {**json.loads(path.read_text()), **{k: v for k, v in moments.items() if k != "start"},
                   "restart": START}
    order = torch.Generator().manual_seed(me)

    def more() -> bool:
        if victim < 0:
            return opt.steps < steps
        joins = [c.step for c in opt.changes if c.joined]
        return not joins or opt.steps < max(steps, joins[0] + 4)

    while more():
        if first_life and me == victim and opt.steps == at:
            path.write_text(json.dumps({**moments, "killed": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        rows = torch.randint(len(train.y), (32,), generator=order)
        F.cross_entropy(model(train.x[rows]), train.y[rows]).backward()
        opt.step()
        opt.zero_grad()
        moments.setdefault("first_step", time.time())
    opt.finish()
    moments["end"] = time.time()
    path.write_text(json.dumps(moments))


if __name__ == "__main__":
    main()
