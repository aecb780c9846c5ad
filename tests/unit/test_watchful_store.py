"""The store a group's rendezvous waits through: its waits end once a member is named gone (or at
its timeout), and everything else is the inner store's."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from distrain.runtime.membership import WatchfulStore


def test_a_wait_returns_the_key_once_set_and_ends_once_someone_is_gone(store):
    gone: list[int] = []
    watchful = WatchfulStore(dist.PrefixStore("g", store), lambda: list(gone), timeout=30.0)
    threading.Timer(0.2, lambda: store.set("g/addr/1", b"here")).start()
    assert watchful.get("addr/1") == b"here"  # waited for it
    watchful.set("addr/0", "mine")
    assert store.get("g/addr/0") == b"mine" and watchful.check(["addr/0"]) and watchful.add("n", 2) == 2
    gone.append(2)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker\(s\) \[2\] gone during the group's rendezvous"):
        watchful.get("addr/2")
    with pytest.raises(RuntimeError, match="gone"):
        watchful.wait(["addr/2"])
    assert time.monotonic() - began < 5  # within a poll each (GONE_POLL_S), not the 30 s


def test_a_wait_for_a_key_nobody_sets_ends_at_its_timeout(store):
    watchful = WatchfulStore(store, lambda: [], timeout=30.0)
    with pytest.raises(RuntimeError, match="timed out"):
        watchful.wait(["never"], datetime.timedelta(seconds=0.3))
    watchful.set_timeout(datetime.timedelta(seconds=0.3))
    with pytest.raises(RuntimeError, match="timed out after 0.3 s"):
        watchful.get("never")


def test_a_link_whose_peer_is_lost_in_its_rendezvous_fails_naming_it_within_a_poll(store):
    """open_link() of ranks [0, 3]: rank 3 marked itself ready and died before it wrote its address
    (it never comes); once ``gone`` says so, the rendezvous ends in LinkMissed naming it, where
    the link's own wait would have lasted its 30 s timeout."""
    from distrain.comm.link import open_link
    from distrain.runtime.membership import LinkMissed

    dead_after = time.monotonic() + 0.3
    began = time.monotonic()
    with pytest.raises(LinkMissed, match=r"rank 0: rank\(s\) \[3\] lost as the link opened") as missed:
        open_link(dist.PrefixStore("link/0-3", store), [0, 3], 0, 4, timeout=30.0,
                  gone=lambda r: r == 3 and time.monotonic() > dead_after)
    assert missed.value.ranks == [3]
    assert time.monotonic() - began < 10


def test_a_group_made_after_an_elastic_default_group_reaches_that_groups_store(store):
    # The default group holds only the C++ side of the store it met in; a group made from it
    # later (hierarchical all-reduce's node groups) calls the Python side, which must still live.
    code = ("import gc, torch.distributed as dist\n"
            "from distrain.runtime.membership import open_first_group\n"
            "membership = open_first_group(0, 1, min_workers=1, backend='gloo', timeout=30)\n"
            "gc.collect()\n"
            "dist.new_group([0])\n"
            "print('made', dist.get_world_size(), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "made 1", done.stderr[-2000:]
