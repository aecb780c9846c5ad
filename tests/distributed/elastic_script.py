"""A user's script for the elastic tests, run by ``distrain launch``: a parameter vector whose
gradient at each step is a fixed vector of the worker's id and the step (so the test can
compute the exact result), SGD with momentum, and worker ``VICTIM`` killing itself (SIGKILL)
as step ``AT`` begins, or between its backward and its step when ``WHERE`` is ``backward``
(only the first time: a worker started again by ``--max-restarts`` joins the others). With
``hang`` it stops itself (SIGSTOP) there instead: alive, its connections open, silent.

With ``WHERE`` ``rejoin`` the workers go on past ``STEPS`` until the restarted one has joined (and
with ``ELASTIC_SERVER_BACK=1`` in the environment, until a lost parameter server has returned),
and 4 steps after that. With ``node``, ``VICTIM`` kills its launcher (SIGKILL) as step ``AT``
begins, taking that launcher's node with it (``distrain launch --nnodes``), and the workers go on
until every worker of the run is back (``--join``) and 4 steps after that.

``SETTINGS`` (optional) is a JSON object of wrap() settings (e.g. DiLoCo's); with ``"split":
true`` in it the parameter vector is two tensors (its halves: DiLoCo's fragments are cut between
tensors), and ``"momentum"`` is SGD's (0.9 by default). With
``ELASTIC_DEVICE=cuda`` in the environment the model and its gradients are on the GPU, the
workers sharing it over gloo. With ``ELASTIC_STACKS=S``, a worker still running after S seconds
prints every thread's stack (what a hung run waits on). With ``ELASTIC_STEPS_OF=W:N``, worker
``W`` takes ``N`` steps instead of ``STEPS`` (asynchronous algorithms: it ends first). With
``ELASTIC_FULL=1`` and ``rejoin``, the workers go on until the last membership change is a join
that leaves every worker in the run (an earlier join may have been undone by a loss), and 4 steps
after it.

With ``wrap``, ``VICTIM`` kills itself before it calls ``wrap()`` (as a script dies loading
its data), once: its next life, started as the first one was, finds ``OUT/killed-before-wrap``.
With ``ELASTIC_INIT=rank`` each worker's parameters start at its rank (all of them alike: 0
otherwise), so that the test can tell whose start ``wrap()`` handed to everyone.

With ``ELASTIC_SAVE_AT=K`` each worker saves its model and ``opt.state_dict()`` once it has
taken K steps (``OUT/state<id>.pt``); with ``ELASTIC_RESUME=DIR`` each starts from DIR's.

Usage: elastic_script.py OUT STEPS VICTIM AT WHERE [SETTINGS]
"""

import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

import torch

import distrain

DIM = 10


def gradient(worker: int, step: int) -> torch.Tensor:
    """The gradient worker ``worker`` contributes at ``step``."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(DIM, generator=g, dtype=torch.float64)


class Split(torch.nn.Module):
    """The parameter vector as two tensors, its halves; ``weight`` is the whole vector."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(1, DIM // 2, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.zeros(1, DIM - DIM // 2, dtype=torch.float64))

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.a, self.b], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : DIM // 2] @ self.a.T + x[:, DIM // 2 :] @ self.b.T


def leaders(opt: "distrain.DistributedOptimizer") -> list[int] | None:
    """Hierarchical all-reduce: the ids of the nodes' leaders in the workers' last group."""
    hierarchy = getattr(opt.algorithm, "hierarchy", None)
    return None if hierarchy is None else [opt.ids[r] for r in hierarchy.nodes.map.leaders]


def main() -> None:
    out, steps, victim, at, where = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    if os.environ.get("ELASTIC_STACKS"):
        faulthandler.dump_traceback_later(float(os.environ["ELASTIC_STACKS"]))
    device = os.environ.get("ELASTIC_DEVICE", "cpu")
    settings = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    if settings.pop("split", False):
        model: torch.nn.Module = Split().to(device)
    else:
        model = torch.nn.Linear(DIM, 1, bias=False).double().to(device)
        torch.nn.init.zeros_(model.weight)
        if os.environ.get("ELASTIC_INIT") == "rank":  # each worker its own start: wrap() hands rank 0's to all
            torch.nn.init.constant_(model.weight, float(os.environ["RANK"]))
    if device != "cpu":
        settings.setdefault("backend", "gloo")
    momentum = settings.pop("momentum", 0.9)
    if where == "wrap" and int(os.environ["RANK"]) == victim and not (out / "killed-before-wrap").exists():
        (out / "killed-before-wrap").write_text("1")
        os.kill(os.getpid(), signal.SIGKILL)
    opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), **settings)
    me, first_life = opt.id, "DISTRAIN_JOIN" not in os.environ
    save_at = int(os.environ.get("ELASTIC_SAVE_AT", "-1"))
    if os.environ.get("ELASTIC_RESUME"):
        saved = torch.load(Path(os.environ["ELASTIC_RESUME"]) / f"state{me}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    world = int(os.environ["WORLD_SIZE"])
    short = os.environ.get("ELASTIC_STEPS_OF", "").split(":")
    own_steps = int(short[1]) if len(short) == 2 and int(short[0]) == me else steps

    syncs: set[int] = set()
    history = []  # the parameters after each of this worker's steps
    returned = []  # the step after which a lost parameter server was back
    server_back = os.environ.get("ELASTIC_SERVER_BACK") == "1"  # a parameter server comes back too
    missed = os.environ.get("ELASTIC_SERVER_BACK") == "missed"  # a parameter server is lost again as it returns

    def more() -> bool:
        if where == "node":  # until the lost node's workers are all back, and 4 steps more
            full = [c.step for c in opt.changes if c.joined and len(c.members) == world][:1]
            return not full or opt.steps < max(steps, full[0] + 4)
        if missed:  # until the members saw it lost again as it returned, and 4 steps more
            if not returned and opt.algorithm.returns_missed:
                returned.append(opt.steps)
            return not returned or opt.steps < max(steps, returned[0] + 4)
        if where != "rejoin":
            return opt.steps < own_steps
        # (a worker that joined after the server's return finds every server whole as it joins)
        if server_back and not returned and (opt.algorithm.returned_servers
                                             or (not first_life and opt.algorithm.layout.whole())):
            returned.append(opt.steps)
        if os.environ.get("ELASTIC_FULL") == "1":  # until the last change lets every worker in, and 4 steps more
            last = opt.changes[-1] if opt.changes else None
            return (last is None or not last.joined or len(last.members) < opt.config.cluster.workers
                    or opt.steps < max(steps, last.step + 4))
        joins = [c.step for c in opt.changes if c.joined][:1] if victim >= 0 else []
        if (victim >= 0 and not joins) or (server_back and not returned):
            return True
        return opt.steps < max(steps, *(b + 4 for b in joins + returned))  # 4 steps more with everyone back

    while more():  # a worker that joins starts where the others are
        step = opt.steps
        if first_life and me == victim and step == at and where in ("start", "rejoin", "node"):
            if where == "node":
                os.kill(os.getppid(), signal.SIGKILL)  # the node's launcher: its other workers die with it
            os.kill(os.getpid(), signal.SIGKILL)
        if me == victim and step == at and where == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)  # alive, connections open, silent: until the launcher ends it
        x = gradient(me, step).reshape(1, DIM).to(device)
        model(x).sum().backward()  # d/dw (w . g) = g
        if first_life and me == victim and step == at and where == "backward":
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
        history.append(model.weight.detach().cpu().reshape(-1).clone())
        if opt.steps == save_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out / f"state{me}.pt")
        syncs.update(getattr(opt.algorithm, "synced_at", []))  # DiLoCo: the steps its rounds ended at
    final = opt.finish()
    syncs.update(getattr(opt.algorithm, "synced_at", []))
    if device != "cpu":
        assert final.weight.device.type == model.weight.device.type == device, (final.weight.device, device)
    torch.save({"weight": final.weight.detach().cpu().clone(), "own": model.weight.detach().cpu().clone(),
                "workers": opt.workers, "ids": opt.ids,
                "steps": opt.steps, "changes": [c.record() for c in opt.changes],
                "rounds": opt.algorithm.metrics().get("gossip_rounds", 0), "server_back": returned,
                "leaders": leaders(opt), "history": torch.stack(history) if history else None,
                "syncs": sorted(syncs - {0})}, out / f"worker{me}.pt")


if __name__ == "__main__":
    main()
