"""dsrl.runtime.phases: per-phase seconds, tokens and peak memory of a rollout.

- on an asynchronous accelerator the clock never synchronizes the device inside or at the end of a phase (timing
  events, read once in ``take``); a clock that synchronizes at each phase end is caught (planted);
- the peak counter is reset at every phase start, so each phase reports its own peak; a clock that does not reset
  it is caught (planted), with a fake accelerator and with the real process's resident peak (Linux VmHWM);
- phases never nest; a phase run several times adds up; listeners hear starts and ends outside the timing;
- the row: mean seconds over ranks, max peaks, rates, only phases that ran; the console line shows the peak.
"""

from __future__ import annotations

import pytest
import torch

from dsrl.runtime import phases as phases_mod
from dsrl.runtime.metrics import MetricsWriter
from dsrl.runtime.phases import PHASES, PhaseClock, PhaseTotals, phase_record


class FakeEvent:
    def __init__(self, accel: FakeAccelerator):
        self.accel, self.t, self.synced = accel, None, False

    def record(self) -> None:
        self.accel.records += 1
        self.t = self.accel.device_time

    def synchronize(self) -> None:
        self.accel.event_waits += 1
        self.synced = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert end.synced, "elapsed_time read before the end event completed"
        return (end.t - self.t) * 1e3


class FakeAccelerator:
    """DeepSpeed's accelerator interface as the clock uses it; the 'device' clock and allocator are driven by
    the test (``run``)."""

    def __init__(self, synchronized: bool = False):
        self.synchronized = synchronized
        self.device_time = 0.0
        self.allocated = self.peak = 0
        self.syncs = self.records = self.event_waits = 0

    def is_synchronized_device(self) -> bool:
        return self.synchronized

    def device_name(self) -> str:
        return "cuda"

    def synchronize(self) -> None:
        self.syncs += 1

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 (DeepSpeed's name)
        assert enable_timing
        return FakeEvent(self)

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def run(self, seconds: float, transient_mib: int) -> None:
        """Work on the device: time passes, ``transient_mib`` is allocated and freed."""
        self.device_time += seconds
        self.peak = max(self.peak, self.allocated + transient_mib * 2**20)


class SyncAtPhaseEnd(PhaseClock):
    """Planted: a clock that synchronizes the device at every phase end to read a wall clock."""

    def __init__(self, accel: FakeAccelerator):
        super().__init__(accel)
        self.accel = accel

    def phase(self, name):  # type: ignore[override]
        inner = super().phase(name)
        accel = self.accel

        class Wrapped:
            def __enter__(self):
                return inner.__enter__()

            def __exit__(self, *exc):
                accel.synchronize()
                return inner.__exit__(*exc)

        return Wrapped()


def _rollout(clock: PhaseClock, accel: FakeAccelerator) -> int:
    """One rollout's phases on the fake device; the synchronizations made while phases were open."""
    clock.start_rollout(0)
    before = accel.syncs
    with clock.phase("generate"):
        accel.run(2.0, 300)
    with clock.phase("reward"):
        accel.run(0.5, 0)
    with clock.phase("old_logprobs"):
        accel.run(1.0, 100)
    with clock.phase("train"):
        accel.run(3.0, 50)
    return accel.syncs - before


@pytest.mark.parametrize("planted", [False, True])
def test_no_device_sync_inside_or_at_the_end_of_a_phase(planted):
    accel = FakeAccelerator()
    clock = SyncAtPhaseEnd(accel) if planted else PhaseClock(accel)
    syncs = _rollout(clock, accel)
    if planted:
        assert syncs == 4  # the guard sees a sync per phase end
        return
    assert syncs == 0 and accel.event_waits == 0 and accel.records == 8  # two events per phase, none waited on
    totals = clock.take()  # waits on the events once per rollout
    assert accel.syncs == 0 and accel.event_waits == 4
    assert totals.seconds == pytest.approx({"generate": 2.0, "reward": 0.5, "old_logprobs": 1.0, "ref_logprobs": 0.0,
                                            "critic_values": 0.0, "train": 3.0})


@pytest.mark.parametrize("planted", [False, True])
def test_each_phase_reports_its_own_peak(planted, monkeypatch):
    accel = FakeAccelerator()
    accel.allocated = 1000 * 2**20  # resident weights etc.
    if planted:
        monkeypatch.setattr(phases_mod._DeviceMemory, "reset", lambda self: None)
    clock = PhaseClock(accel)
    _rollout(clock, accel)
    peaks = clock.take().peak_mib
    own = {"generate": 1300.0, "reward": 1000.0, "old_logprobs": 1100.0, "train": 1050.0}
    if planted:
        assert peaks["reward"] == 1300.0 and peaks["train"] == 1300.0  # the generate peak leaks into later phases
        return
    assert {p: peaks[p] for p in own} == own
    assert peaks["ref_logprobs"] is None and peaks["critic_values"] is None


def _fill(mib: int) -> torch.Tensor:
    return torch.ones(mib * 2**20 // 4, dtype=torch.float32)  # written, so resident


@pytest.mark.skipif(not phases_mod._ResidentPeak.available(), reason="needs Linux /proc/self/clear_refs and VmHWM")
@pytest.mark.parametrize("planted", [False, True])
def test_cpu_peak_is_the_resident_high_water_mark_of_each_phase(planted, monkeypatch):
    """On the CPU the clock reads the kernel's peak RSS per phase (DeepSpeed's CPU accelerator only samples it)."""
    if planted:
        monkeypatch.setattr(phases_mod._ResidentPeak, "reset", lambda self: None)
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    clock = PhaseClock(CPU_Accelerator())
    assert clock.reads_memory
    clock.start_rollout(0)
    with clock.phase("generate"):
        big = _fill(256)
        del big
    with clock.phase("train"):
        small = _fill(8)
        del small
    peaks = clock.take().peak_mib
    if planted:
        assert peaks["train"] >= peaks["generate"]
        return
    assert peaks["generate"] - peaks["train"] > 128, peaks


def test_cpu_accelerator_times_with_the_host_clock():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    clock = PhaseClock(CPU_Accelerator())
    assert isinstance(clock._timer, phases_mod._HostTimer)
    clock.start_rollout(0)
    with clock.phase("reward"):
        sum(range(10000))
    assert clock.take().seconds["reward"] > 0


def test_phases_do_not_nest_and_add_up_and_names_are_checked():
    accel = FakeAccelerator()
    clock = PhaseClock(accel)
    clock.start_rollout(3)
    with pytest.raises(RuntimeError, match="'reward' started inside phase 'generate'"), clock.phase("generate"):
        with clock.phase("reward"):
            pass
    with pytest.raises(ValueError, match="unknown phase 'sampling'"), clock.phase("sampling"):
        pass
    for _ in range(3):  # e.g. dynamic sampling rounds
        with clock.phase("generate"):
            accel.run(1.0, 10)
    totals = clock.take()
    assert totals.runs["generate"] == 4 and totals.seconds["generate"] == pytest.approx(3.0)
    assert clock.rollout == 4  # take() starts the next rollout


def test_listeners_hear_phases_outside_the_timing():
    accel = FakeAccelerator()
    clock = PhaseClock(accel)
    heard = []

    class Listener:
        def phase_started(self, name, rollout):
            heard.append(("start", name, rollout))
            accel.run(5.0, 0)  # e.g. a profiler starting: not the phase's time

        def phase_ended(self, name, rollout):
            heard.append(("end", name, rollout))
            accel.run(5.0, 0)

    clock.add_listener(Listener())
    clock.start_rollout(2)
    with clock.phase("old_logprobs"):
        accel.run(1.0, 0)
    assert heard == [("start", "old_logprobs", 2), ("end", "old_logprobs", 2)]
    assert clock.take().seconds["old_logprobs"] == pytest.approx(1.0)


def test_row_means_seconds_over_ranks_takes_peak_maxima_and_skips_phases_that_never_ran():
    totals = PhaseTotals()  # as reduced over 2 ranks
    totals.seconds.update(generate=4.0, reward=1.0, old_logprobs=2.0, train=6.0)
    totals.runs.update(generate=2, reward=2, old_logprobs=2, train=2)
    totals.peak_mib.update(generate=300.0, reward=None, old_logprobs=500.0, train=400.0)
    totals.generated_tokens, totals.trained_tokens = 1000, 6000
    row = phase_record(totals, world=2)
    assert row["phase_generate_s"] == 2.0 and row["phase_train_s"] == 3.0 and row["phase_old_logprobs_s"] == 1.0
    assert "phase_ref_logprobs_s" not in row and "peak_critic_values_mib" not in row
    assert row["peak_reward_mib"] is None and row["peak_mib"] == 500.0
    assert row["generate_tokens_per_s"] == 500.0 and row["train_sequence_tokens_per_s"] == 2000.0
    assert set(PHASES) >= {k.removeprefix("phase_").removesuffix("_s") for k in row if k.startswith("phase_")}
    assert totals.reduced() == totals  # one process: the reduction is the identity


def test_console_line_shows_the_peak_when_known(tmp_path):
    writer = MetricsWriter(str(tmp_path), rank=0)
    rec = {"rollout": 1, "optimizer_step": 2, "rollout_s": 1.0, "train_s": 2.0}
    assert "peak" not in writer.rollout_line(rec, 4)
    assert writer.rollout_line({**rec, "peak_mib": 1536.4}, 4).endswith("| peak 1,536 MiB")
    writer.close()
