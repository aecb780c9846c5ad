"""One worker as a torchft replica group: its Manager, a metered gloo group, a loopback store.

torchft reports no byte counts, and its collectives run on its own reconfigurable gloo group,
outside distrain's Transport. :class:`MeteredGloo` is torchft's ``ProcessGroupGloo`` whose
all-reduces are counted and delayed like DDP's (:mod:`distrain.baselines.wire`): each one is
charged as a ring all-reduce of the tensors' bytes (``2(n-1)/n`` of them to the next worker) and,
on an emulated network, returns only once that ring would have finished on the emulated links
(``WireMeter.synchronous``: the link model's arithmetic for distrain's own all-reduce, starting
when the real all-reduce is done, i.e. when every replica has contributed). torchft's DiLoCo and
LocalSGD send nothing else on the group. The quorum and commit messages between the Managers and
the lighthouse are small control messages on their own connections: neither counted nor delayed.

Each worker is a replica group of one rank: a TCPStore of its own on 127.0.0.1, a Manager whose
server advertises 127.0.0.1 (torchft 0.2.0 binds that server to every interface; its
constructor offers no bind address) and which never transfers checkpoints (:class:`NoCheckpoints`:
every replica starts from the same seeded parameters, ``init_sync=False``, so nobody heals; this
also keeps torchft's HTTP checkpoint server, which would listen on every interface, from
starting). A round that torchft does not commit fails the run (``max_retries=0``): these peers
are measured on networks that are slow, not lossy.

Example::

    replica = open_replica(rank=0, replicas=4, lighthouse="http://127.0.0.1:29510", meter=meter,
                           timeout=120.0)
    ...  # torchft.local_sgd.DiLoCo(replica.manager, [model], inner, outer, sync_every=H)
    replica.close()
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchft.checkpointing import CheckpointTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from distrain.baselines.wire import WireMeter
from distrain.comm.group import listen_on
from distrain.errors import DistrainError

# The Manager warns on CPU, at every new quorum, that it cannot reset NCCL's flight recorder.
logging.getLogger("torchft.manager").addFilter(lambda record: "flight recorder" not in record.getMessage())


#: Longest wait for the lighthouse (it starts beside the workers) and the Managers' servers.
CONNECT_TIMEOUT = datetime.timedelta(seconds=60)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class MeteredGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group whose all-reduces ``meter`` counts and delays.

    Args:
        meter: this worker's :class:`WireMeter` (world: the number of replicas).
        timeout: seconds a collective may take.
    """

    def __init__(self, meter: WireMeter, timeout: datetime.timedelta) -> None:
        super().__init__(timeout=timeout)
        self.meter = meter
        self.all_reduces = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._metered(super().allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._metered(super().allreduce_coalesced(tensors, opts), tensors)

    def _metered(self, work: Any, tensors: list[torch.Tensor]) -> Any:
        # Waited for here, not by the Manager: the emulated transfer starts when the real one
        # is over. torchft's DiLoCo and LocalSGD wait for every all-reduce at once anyway.
        start = time.perf_counter()
        work.wait()
        self.meter.synchronous([_nbytes(tensors)], start)
        self.all_reduces += 1
        return work


class NoCheckpoints(CheckpointTransport[Any]):
    """A checkpoint transport that refuses to transfer: no replica of a distrain run heals."""

    def metadata(self) -> str:
        return "distrain: no checkpoint transfers"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: datetime.timedelta) -> None:
        raise DistrainError(f"torchft asked to send a checkpoint to replicas {dst_ranks} at step {step}; "
                            "distrain's torchft peers start every replica alike and do not heal")

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: datetime.timedelta) -> Any:
        raise DistrainError(f"torchft asked for a checkpoint from replica {src_rank} at step {step}; "
                            "distrain's torchft peers start every replica alike and do not heal")


@dataclass
class Replica:
    """A worker's torchft replica group: its Manager, process group and store."""

    manager: Manager
    group: MeteredGloo
    store: dist.TCPStore

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        self.group.shutdown()


def replica_id(rank: int) -> str:
    """The replica id of worker ``rank``: zero-padded, so that torchft orders replicas by rank."""
    return f"distrain_{rank:05d}"


def open_replica(rank: int, replicas: int, lighthouse: str, meter: WireMeter, timeout: float) -> Replica:
    """Make worker ``rank`` a torchft replica group of one rank, meeting ``replicas`` - 1 others
    through the lighthouse at ``lighthouse``; every wait (collectives, quorum, connections) is
    bounded by ``timeout`` seconds."""
    limit = datetime.timedelta(seconds=timeout)
    fd, port = listen_on("127.0.0.1", 0)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=limit, master_listen_fd=fd)
    group = MeteredGloo(meter, limit)
    manager = Manager(  # waits for the lighthouse to listen, up to connect_timeout
        pg=group, load_state_dict=None, state_dict=None, min_replica_size=replicas, use_async_quorum=False,
        timeout=limit, quorum_timeout=limit, connect_timeout=min(limit, CONNECT_TIMEOUT), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=port, lighthouse_addr=lighthouse, replica_id=replica_id(rank),
        hostname="127.0.0.1", checkpoint_transport=NoCheckpoints(), init_sync=False, max_retries=0)
    return Replica(manager, group, store)
