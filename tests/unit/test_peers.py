"""Which ranks of the job still run (dsrl.runtime.peers), and what a stop does with it (dsrl.runtime.stop).

- (real processes told apart, and a stuck rank ended after its caller exited: tests/distributed/test_peer_processes.py)
- a stop request that finds a rank ended is named, shared, and ends the run with status 1;
- the start-up agreement's one error: every rank's problems once, ConfigError first;
- every cross-section problem of a run file at once (the shipped async config turned colocated).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from dsrl.config import ConfigError, load_config
from dsrl.core.collectives import shared_error
from dsrl.core.errors import RunError
from dsrl.rl.disagg.wire import describe_failure
from dsrl.runtime.stop import StopControl


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
