"""Prague goes on without a worker killed (SIGKILL) at a fixed step: its group partners (or the
group generator) find it gone, it is never grouped again, the survivors finish their budget, and
their consensus leaves it out."""

from __future__ import annotations

import pytest

from tests.reliability.test_adpsgd_dead_worker import kill_one_of_four

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]  # `make test-all`

# A larger test set than QUICK's, so that two runs' accuracies differ by less than the 2 points allowed.
PRAGUE = ["--algorithm", "prague", "--epochs", "2", "--num-samples", "9600"]


def test_kill_one_of_four_the_three_survivors_finish_without_it(tmp_path):
    kill_one_of_four(tmp_path, PRAGUE, three_flags=["--group-size", "2"])
