"""The start-up preflight: every rank of the job checks in with rank 0 within a bound, before any work.

Rank 0 hosts the job's TCP store at ``MASTER_ADDR:MASTER_PORT`` (under torchrun its agent does); every
rank records there the node its launcher put it on (:class:`dsrl.core.launchers.Launch`) and adds itself to
a count. Rank 0 waits until the count is the world size or ``bound_s`` has passed, then writes a verdict:
empty when every rank is there, or one sentence naming the nodes whose ranks never checked in (as the
launcher names them: a hostfile entry, a Slurm node), the launcher and the fix (:func:`missing_sentence`).
Every rank that checked in reads the verdict, so on a failure the whole started job ends at once with
status 1, the sentence printed by rank 0 alone; rank 0 keeps the store up until they have read it (a few
seconds at most). A rank that cannot reach rank 0's store within the bound ends with a sentence naming the
address. Nothing here touches the output directory: the trainer opens it only after the process group
exists.

The store then carries the default process group: :func:`init_method` registers a torch rendezvous handler
(``torch.distributed.rendezvous.register_rendezvous_handler``) that hands it over, so that
``deepspeed.init_distributed(init_method=...)`` builds the group exactly as DeepSpeed does (backend, device
binding), on the store whose ranks have all checked in, and on no second port.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dsrl.core.errors import RunError
from dsrl.core.launchers import Launch

PREFIX = "dsrl/preflight/"
COUNT, VERDICT, ACK = f"{PREFIX}count", f"{PREFIX}verdict", f"{PREFIX}ack"
SCHEME = "dsrl"
ACK_WAIT_S = 5.0  # how long rank 0 keeps the store up for the ranks that read a failed verdict
BOUND_SETTING = "dsrl.run.join_timeout_s"


class PreflightError(RunError):
    """The preflight failed: the job ends before any work. Raised by rank 0 with the sentence it prints, and by every
    rank that checked in with the same sentence, marked agreed, after rank 0 has it: those ranks end within
    :data:`PRINT_GRACE_S` instead of waiting for the launcher."""


PRINT_GRACE_S = 2.0  # what a rank leaving the message to rank 0 gives it before ending


def ranges(ranks: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(f"{ranks[i]}-{ranks[j]}" if j > i else f"{ranks[i]}")
        i = j + 1
    return ", ".join(out)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def missing_sentence(launch: Launch, missing: Sequence[int], seen: dict[int, str], bound_s: float) -> str:
    """The preflight's failure, in one sentence: which nodes (or, where the launcher does not say where ranks run,
    which ranks) never checked in within ``bound_s``, the launcher and the fix. ``seen``: rank -> node of every rank
    that did."""
    world = launch.world_size
    lost = (f"{len(missing)} of the job's {world} ranks ({'rank' if len(missing) == 1 else 'ranks'} "
            f"{ranges(missing)}) {'is' if len(missing) == 1 else 'are'} missing")
    absent: list[str] = []
    if launch.nodes is not None:
        arrived = Counter(seen.values())
        parts = []
        for node, expected in launch.nodes:
            got = arrived.get(node, 0)
            if got < expected:
                absent.append(node)
                parts.append(f"host {node} checked in only {got} of its {expected} ranks" if got
                             else f"host {node} never checked in")
        what = f"{', '.join(parts)}: {lost}" if parts else lost
    else:
        what = (f"{lost} (those that checked in run on {', '.join(sorted(set(seen.values())))}; {launch.name} does "
                "not say where the others were placed)")
    return (f"preflight: {what} within {bound_s:g} s ({BOUND_SETTING}), launched with {launch.name}; fix: "
            f"{launch.fix(absent)}; nothing was written to the output directory")


def _unreachable_sentence(launch: Launch, bound_s: float, exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return (f"preflight: rank {launch.rank} on host {launch.node} could not reach rank 0's rendezvous at "
            f"{launch.master_addr}:{launch.master_port} within {bound_s:g} s ({BOUND_SETTING}), launched with "
            f"{launch.name}; fix: check that rank 0 started (its host's lines above) and that "
            f"{launch.master_addr} resolves to rank 0's node and port {launch.master_port} is open from "
            f"{launch.node} (set MASTER_ADDR/MASTER_PORT for every rank to choose them); nothing was written to the "
            f"output directory ({first})")


def check_in(launch: Launch, bound_s: float) -> Any:
    """Create the job's TCP store and run the preflight (module docstring); returns the store (a
    ``torch.distributed.TCPStore``) once every rank has checked in. Raises :class:`RunError` otherwise: on rank 0
    with the sentence of :func:`missing_sentence`; on the others the same sentence marked agreed (rank 0 prints it),
    or their own when rank 0 cannot be reached."""
    rank, world = launch.rank, launch.world_size
    bound = timedelta(seconds=bound_s)
    # Under torchrun the agent already hosts the store at MASTER_ADDR:MASTER_PORT: every rank is a client (as
    # torch's env:// rendezvous does); otherwise rank 0 hosts it.
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    try:
        store = dist.TCPStore(launch.master_addr, launch.master_port, world, is_master=hosts, timeout=bound,
                              wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if rank == 0:
            raise PreflightError(f"preflight: rank 0 on host {launch.node} could not open the job's rendezvous at "
                           f"{launch.master_addr}:{launch.master_port} ({str(e).splitlines()[0][:200]}), launched "
                           f"with {launch.name}; fix: choose a free MASTER_PORT (another job may hold this one); "
                           "nothing was written to the output directory") from e
        raise PreflightError(_unreachable_sentence(launch, bound_s, e)) from e
    node = json.dumps([launch.node, socket.gethostname(), os.getpid()])
    store.set(f"{PREFIX}rank/{rank}", node)
    store.add(COUNT, 1)
    if rank == 0:
        _judge(store, launch, bound_s)
        return store
    try:
        # Polled, not store.wait: a signal (the launcher's SIGTERM) is handled within a quarter second; the pause grows
        # so that thousands of waiting ranks do not flood rank 0's store.
        deadline, pause = time.monotonic() + bound_s + 30.0, 0.02
        while not store.check([VERDICT]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no verdict within {bound_s + 30:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.25)
        verdict = store.get(VERDICT).decode()
        store.add(ACK, 1)
    except (RuntimeError, OSError) as e:
        raise PreflightError(f"preflight: rank {launch.rank} on host {launch.node} checked in with rank 0 at "
                       f"{launch.master_addr}:{launch.master_port} but never heard back within {bound_s + 30:g} s, "
                       f"launched with {launch.name}; fix: see rank 0's lines (its process may have ended); nothing "
                       "was written to the output directory") from e
    if verdict:
        raise PreflightError(verdict, agreed=True)
    return store


def _judge(store: Any, launch: Launch, bound_s: float) -> None:
    """Rank 0: wait for every rank, then write the verdict (and on a failure, raise it)."""
    world = launch.world_size
    deadline = time.monotonic() + bound_s
    pause = 0.01
    while (arrived := store.add(COUNT, 0)) < world and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
    if arrived >= world:
        store.set(VERDICT, b"")
        return
    seen: dict[int, str] = {}
    missing = []
    for r in range(world):
        key = f"{PREFIX}rank/{r}"
        if store.check([key]):
            seen[r] = str(json.loads(store.get(key).decode())[0])
        else:
            missing.append(r)
    sentence = missing_sentence(launch, missing, seen, bound_s)
    store.set(VERDICT, sentence.encode())
    ack_deadline = time.monotonic() + ACK_WAIT_S
    while store.add(ACK, 0) < len(seen) - 1 and time.monotonic() < ack_deadline:
        time.sleep(0.05)
    raise PreflightError(sentence)


# --------------------------------------------------------------------------------------------
# handing the store to torch.distributed


_HANDED: list[tuple[Any, int, int]] = []


def _handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    if not _HANDED:
        raise RuntimeError(f"{SCHEME}:// rendezvous without a preflight store (dsrl.core.rendezvous.check_in)")
    yield _HANDED.pop()


def init_method(store: Any, launch: Launch) -> str:
    """The ``init_method`` URL under which ``torch.distributed.init_process_group`` (via DeepSpeed) takes ``store``
    as the default group's rendezvous, with this rank and world size."""
    import importlib

    try:
        importlib.import_module("torch.distributed.rendezvous").register_rendezvous_handler(SCHEME, _handler)
    except RuntimeError:  # already registered in this process
        pass
    _HANDED[:] = [(store, launch.rank, launch.world_size)]
    return f"{SCHEME}://"
