"""Prague goes on without a worker killed (SIGKILL) at a fixed step: its group partners (or the
group generator) find it gone, it is never grouped again, the survivors finish their budget, and
their consensus leaves it out."""

from __future__ import annotations

import pytest

from tests.reliability.common import QUICK, run_losing_worker
from tests.reliability.test_adpsgd_dead_worker import (
    finite_final_models,
    kill_one_of_four,
    survivors_took_over_its_data,
)

pytestmark = pytest.mark.timeout(400)

# A larger test set than QUICK's, so that two runs' accuracies differ by less than the 2 points allowed.
PRAGUE = ["--algorithm", "prague", "--epochs", "2", "--num-samples", "9600"]
#: The CI's kill test: half the budget (60 steps per worker; the kill comes at step 30).
PRAGUE_SHORT = ["--algorithm", "prague", "--epochs", "1", "--num-samples", "4800"]


@pytest.mark.slow  # `make test-all`: test_elastic.py's Prague test (worker 0 lost, through wrap()) is the CI's
@pytest.mark.parametrize("rank", [0, 2])
def test_a_killed_worker_is_never_grouped_again(tmp_path, rank):
    """A worker dies: its partner or the generator finds it gone, and the three others finish the
    whole budget in groups without it. Worker 0 runs the group generator: worker 1 takes over."""
    run_dir = tmp_path / "run"
    run, summary = run_losing_worker(run_dir, [*QUICK, *PRAGUE_SHORT, "--workers", "4", "--epochs", "3"], rank=rank)
    assert f"worker {rank} was killed by SIGKILL; the other workers finished without it" in run.stderr
    if rank == 0:
        assert "worker 1 forms the groups from now on" in run.stderr
    survivors = [r for r in range(4) if r != rank]
    steps = summary["steps_per_worker"]
    assert min(steps[i] for i in survivors) > 30
    assert sum(steps) + 30 >= summary["steps"] * 4  # the survivors used the whole (global) budget
    finite_final_models(run_dir, survivors)
    survivors_took_over_its_data(run_dir, rank, survivors)


@pytest.mark.slow  # `make test-all`: three runs; the test above is the CI's
def test_kill_one_of_four_the_three_survivors_finish_without_it(tmp_path):
    kill_one_of_four(tmp_path, PRAGUE, three_flags=["--group-size", "2"])
