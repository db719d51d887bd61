"""Which ranks of the job still run (dsrl.runtime.peers), and what a stop does with it (dsrl.runtime.stop).

- a rank's process that exited, is a zombie, or whose pid now belongs to another process has ended; a stopped one
  is frozen; a running one, or one on another host, is not reported; the sentence names role, rank and host;
- a rank declared stuck is ended only after the caller's process has exited (so the launcher sees the caller's
  status first), and only if its pid still belongs to it;
- a stop request that finds a rank ended is named, shared, and ends the run with status 1;
- the start-up agreement's one error: every rank's problems once, ConfigError first;
- every cross-section problem of a run file at once (the shipped async config turned colocated).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dsrl.config import ConfigError, load_config
from dsrl.core.collectives import shared_error
from dsrl.core.errors import RunError
from dsrl.rl.disagg.wire import describe_failure
from dsrl.runtime.peers import ENDED, FROZEN, Peers, Process, this_process
from dsrl.runtime.stop import StopControl

HOST = socket.gethostname()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _process(p: subprocess.Popen) -> Process:
    return Process(HOST, p.pid, psutil.Process(p.pid).create_time())


def test_ended_frozen_and_running_ranks_are_told_apart():
    me, running, stopped, dead = this_process(), _sleeper(), _sleeper(), _sleeper()
    records = [me, _process(running), _process(stopped), _process(dead), Process("elsewhere", 1, 0.0),
               Process(HOST, os.getpid(), me.started - 100.0)]  # the last: a pid that now belongs to another process
    try:
        stopped.send_signal(signal.SIGSTOP)
        dead.kill()
        dead.wait()
        time.sleep(0.2)
        peers = Peers(0, records, label=lambda r: "generator 0" if r == 2 else f"trainer {r}")
        assert peers.ended() == {2: FROZEN, 3: ENDED, 5: ENDED}
        assert peers.obituary() == (f"generator 0 (rank 2 on host {HOST}) {FROZEN}; trainer 3 (rank 3 on host "
                                    f"{HOST}) {ENDED}; trainer 5 (rank 5 on host {HOST}) {ENDED}")
        assert peers.speaks_for_host() and not Peers(1, records).speaks_for_host()
        assert Peers(0, records[:2]).obituary() is None
    finally:
        for p in (running, stopped):
            p.kill()
            p.wait()


CALLER = r"""
import json, sys, time
from dsrl.runtime.peers import Peers, Process, this_process
target = Process(*json.loads(sys.argv[1]))
print(Peers(0, [this_process(), target]).end_after_exit([1], delay_s=0.3), flush=True)
time.sleep(1.0)
"""


@pytest.mark.parametrize("same_process", [True, False])
def test_a_stuck_rank_is_ended_only_after_the_caller_exited(same_process):
    target = _sleeper()
    record = _process(target)
    if not same_process:  # planted: the recorded start time is another process's: its pid is not the rank's
        record = Process(record.host, record.pid, record.started - 100.0)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    try:
        caller = subprocess.Popen([sys.executable, "-c", CALLER, json.dumps([record.host, record.pid,
                                                                            record.started])],
                                  env=env, stdout=subprocess.PIPE, text=True)
        assert caller.stdout.readline().strip() == "[1]"
        time.sleep(0.5)
        assert target.poll() is None  # the caller still runs: nothing ended yet
        caller.wait(timeout=30)
        deadline = time.monotonic() + 30
        while target.poll() is None and time.monotonic() < deadline and same_process:
            time.sleep(0.1)
        time.sleep(0.0 if same_process else 1.5)
        assert (target.poll() == -signal.SIGKILL) if same_process else target.poll() is None
    finally:
        target.kill()
        target.wait()


class _Peers:
    def __init__(self, text):
        self.text = text

    def obituary(self):
        return self.text

    def speaks_for_host(self):
        return True


def test_a_stop_that_finds_an_ended_rank_is_a_run_error():
    stop = StopControl(25.0, peers=lambda: _Peers("generator 0 (rank 2 on host a) has ended (its process is gone)"))
    stop.begin_training()
    stop.request("SIGTERM received", signal.SIGTERM)
    assert stop.ended.startswith("generator 0") and stop.peer_ended and stop.exit_code == 1
    plain = StopControl(25.0, peers=lambda: _Peers(None))
    plain.begin_training()
    plain.request("SIGTERM received", signal.SIGTERM)
    assert plain.ended is None and plain.exit_code == 143
    # the run ends on an agreed error: ranks that exit now have not died
    ending = StopControl(25.0, peers=lambda: _Peers("trainer 1 (rank 1 on host a) has ended (its process is gone)"))
    ending.begin_training()
    ending.end_run()
    ending.request("SIGTERM received", signal.SIGTERM)
    assert ending.ended is None and ending.exit_code == 143
    for s in (stop, plain, ending):
        s.uninstall()


def test_the_start_agreement_raises_every_ranks_problem_once():
    assert shared_error([None, None]) is None
    err = shared_error([None, ("run", "r"), ("config", "a"), ("config", "a"), ("config", "b")])
    assert isinstance(err, ConfigError) and err.agreed and str(err) == "2 problems:\n  - a\n  - b"
    err = shared_error([("run", "gone"), None])
    assert isinstance(err, RunError) and err.agreed and str(err) == "gone"


def test_a_peers_failure_is_a_few_words_not_a_cut_cpp_message():
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:43914. This is typically caused by a remote worker crashing.")
    assert describe_failure(gloo) == "its connection closed"
    assert describe_failure(RuntimeError("[a.cc:1] Something odd. More")) == "Something odd"


def test_every_cross_section_problem_of_a_run_file_is_reported_at_once():
    raw = json.loads((Path(__file__).parents[2] / "configs" / "tiny_grpo_async_cpu.json").read_text())
    raw["dsrl"]["rollout"]["placement"] = "colocated"  # the shipped async config turned colocated
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    assert len(e.value.problems) == 2 and str(e.value).startswith("2 problems:"), str(e.value)
    assert "generator_ranks = 1 with placement 'colocated'" in e.value.problems[0]
    assert "max_staleness = 1 with rollout.placement 'colocated'" in e.value.problems[1]
    raw["dsrl"]["rollout"]["generator_ranks"] = 0
    raw["dsrl"]["algorithm"]["max_staleness"] = 0
    assert load_config(raw).dsrl.rollout.placement == "colocated"  # the second try works
