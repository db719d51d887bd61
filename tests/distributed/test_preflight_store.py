"""The start-up preflight's check-in over a real TCP store (dsrl.core.rendezvous), ranks in threads of one
process, with real time bounds: every rank arriving passes and the store goes on to carry the process group; a
host that never starts is named by rank 0 and agreed by the others without waiting out the grace; a rank that cannot
reach rank 0 says where it looked; under torchrun every rank is a client of the agent's store. (The sentence and
the launchers' variables are unit-tested in tests/unit/test_launchers.py; real launches in the extended tier.)"""

from __future__ import annotations

import socket
import threading
import time

from dsrl.core import rendezvous
from dsrl.core.launchers import Launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_in_all(world: int, ranks: list[int], bound_s: float, port: int | None = None
                  ) -> tuple[dict[int, object], float]:
    """Run the preflight for ``ranks`` of a ``world``-rank job, each in a thread; returns what each got (its store
    or the exception) and the wall time."""
    port = port or _free_port()
    got: dict[int, object] = {}
    nodes = tuple((f"node{r}", 1) for r in range(world))

    def one(rank: int) -> None:
        launch = Launch("pdsh", rank, 0, world, 1, f"node{rank}", "127.0.0.1", port, nodes)
        try:
            got[rank] = rendezvous.check_in(launch, bound_s)
        except Exception as e:  # noqa: BLE001 - recorded for the asserts
            got[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got, time.monotonic() - start


def test_check_in_passes_when_every_rank_arrives_and_names_the_missing_host_otherwise():
    got, _ = _check_in_all(3, [0, 1, 2], 20)
    assert all(not isinstance(v, Exception) for v in got.values()), got
    assert got[0].get(rendezvous.VERDICT) == b""  # the store goes on to carry the process group

    got, wall = _check_in_all(3, [0, 1], 1)  # rank 2's host never starts it
    assert isinstance(got[0], rendezvous.PreflightError) and not got[0].agreed
    assert "host node2 never checked in: 1 of the job's 3 ranks (rank 2) is missing within 1 s" in str(got[0])
    assert isinstance(got[1], rendezvous.PreflightError) and got[1].agreed and str(got[1]) == str(got[0])
    assert wall < 1 + rendezvous.ACK_WAIT_S  # rank 1 acknowledged at once: rank 0 did not wait out the grace


def test_a_rank_that_cannot_reach_rank_0_says_where_it_looked():
    got, wall = _check_in_all(2, [1], 1)
    assert isinstance(got[1], rendezvous.PreflightError)
    assert "rank 1 on host node1 could not reach rank 0's rendezvous at 127.0.0.1:" in str(got[1]), got[1]
    assert wall < 20


def test_under_torchrun_every_rank_is_a_client_of_the_agents_store(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist

    port = _free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    got, _ = _check_in_all(2, [0, 1], 10, port=port)  # rank 0 hosting too would fail: the port is taken
    assert all(not isinstance(v, Exception) for v in got.values()), got
    assert agent.get(rendezvous.VERDICT) == b""
