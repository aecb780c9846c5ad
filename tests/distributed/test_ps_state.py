"""A server's optimizer state between processes (wrap()'s state_dict() under ps): a nested dict of
tensors and plain values arrives whole over real gloo point-to-point messages, never pickled."""

from __future__ import annotations

import torch

from distrain.algorithms.parameter_server import recv_state, send_state
from distrain.comm import Transport
from tests.harness import run_group
from tests.reliability.common import run_launch


def adam_like_state() -> dict:
    shard = torch.nn.Parameter(torch.arange(10, dtype=torch.float32))
    optimizer = torch.optim.Adam([shard], lr=0.01, betas=(0.8, 0.95))
    shard.grad = torch.linspace(-1, 1, 10)
    optimizer.step()
    return {"optimizer": optimizer.state_dict(), "updates": 7, "steps": 3, "clocks": [3, 3], "note": None,
            "rows": torch.ones(2, 3, dtype=torch.int64)}


def _exchange(rank: int, world: int) -> dict:
    transport = Transport()
    if rank == 0:
        send_state(transport, adam_like_state(), 1)
        return {}
    got = recv_state(transport, 0)
    state = got["optimizer"]["state"][0]  # the parameter's index stays an int key
    return {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"], "step": state["step"],
            "rows": got["rows"], "updates": torch.tensor(got["updates"]), "clocks": torch.tensor(got["clocks"]),
            "betas": torch.tensor(got["optimizer"]["param_groups"][0]["betas"], dtype=torch.float64),
            "note_is_none": torch.tensor(got["note"] is None)}


def test_a_servers_state_arrives_whole_and_loads_into_the_same_optimizer():
    results = run_group(_exchange, world=2)
    sent = adam_like_state()
    expected = sent["optimizer"]["state"][0]
    got = results[1]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
        assert got[key].dtype == expected[key].dtype and got[key].shape == expected[key].shape
    torch.testing.assert_close(got["rows"], sent["rows"], rtol=0, atol=0)
    assert int(got["updates"]) == 7 and got["clocks"].tolist() == [3, 3] and bool(got["note_is_none"])
    assert got["betas"].tolist() == [0.8, 0.95]


REFUSALS = """
import torch, distrain
model = torch.nn.Linear(4, 2)
opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm="ps")

def refused(call):
    before = [p.detach().clone() for p in model.parameters()], opt.steps
    try:
        call()
    except Exception as exc:
        assert all(torch.equal(a, p) for a, p in zip(before[0], model.parameters())) and opt.steps == before[1]
        print(f"refused {type(exc).__name__}: {exc}", flush=True)
        return
    raise SystemExit("not refused")

start = opt.state_dict()
refused(lambda: opt.load_state_dict({**start, "steps": 5, "servers": [{}, {}]}))
model(torch.randn(8, 4)).pow(2).mean().backward()
opt.step()
opt.zero_grad()
saved = opt.state_dict()
assert len(saved["servers"]) == 1 and opt.steps == 1
refused(lambda: opt.load_state_dict(saved))
opt.finish()
refused(opt.state_dict)
"""


def test_the_servers_refuse_a_state_they_cannot_take_and_nothing_is_loaded(tmp_path):
    # Of another number of servers, after the first step, or asked for after finish(): each a
    # clear error on every worker, with the model and step count untouched, and the run goes on.
    script = tmp_path / "refusals.py"
    script.write_text(REFUSALS)
    done = run_launch(["--workers", "2", "--servers", "1", "--timeout", "30", str(script)])
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    for line in ("refused ConfigError: servers: the saved state is of 2 servers, this run has 1",
                 "refused RuntimeError: load_state_dict() under algorithm='ps' must come before the first step",
                 "refused RuntimeError: state_dict() under algorithm='ps' after this worker's training ended"):
        assert out.count(line) == 2, (line, out[-3000:])
