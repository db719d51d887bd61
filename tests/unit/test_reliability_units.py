"""Single-process tests of issue 12's pieces: the output directory (resume sources, refusals, lock,
preflight), checkpoint manifests and ``latest``, the reward contract, the join bound, stop decisions."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsrl.checkpoint import commit as ckpt
from dsrl.checkpoint import manifest, run_dir
from dsrl.checkpoint.elastic import Layout, check_compatible, needs_universal, saved_layout
from dsrl.checkpoint.output_lock import OutputLock
from dsrl.config import ConfigError, DataConfig, load_config
from dsrl.core import timeouts
from dsrl.rl.data.prompts import load_prompts
from dsrl.rl.rewards.contract import all_timed_out
from dsrl.rl.rewards.functions import as_batched
from dsrl.runtime.metrics import MetricsWriter
from dsrl.runtime.stop import StopControl, _looks_like_launcher

# ------------------------------------------------------------------------------ fake checkpoints


def make_checkpoint(ckpt_dir: Path, tag: str, files: dict[str, bytes] | None = None, commit: bool = True) -> Path:
    root = ckpt_dir / tag
    root.mkdir(parents=True)
    for name, data in (files or {"mp_rank_00_model_states.pt": b"x" * 100, "hf/config.json": b"{}"}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    if commit:
        manifest.write(str(root), manifest.collect(str(root), checksums=True),
                       {".": Layout(2, 2, 2, world_size=2).to_dict()}, tag)
        (root / ckpt.COMPLETE).write_text(tag)
        (ckpt_dir / ckpt.LATEST).write_text(tag)
    return root


def run_cfg(out: Path, resume: str = "auto", overwrite: bool = False) -> SimpleNamespace:
    return SimpleNamespace(output_dir=str(out), resume=resume, overwrite=overwrite, save_final=True, save_every=1,
                           stop_after_rollouts=None, export_final=True)


# ------------------------------------------------------------------------------ manifest and latest


def test_manifest_names_truncated_changed_and_missing_files(tmp_path):
    root = make_checkpoint(tmp_path, "rollout1", {"a.pt": b"a" * 50, "sub/b.pt": b"b" * 20, "c.pt": b"c"})
    doc = manifest.read(str(root))
    assert set(doc["files"]) == {"a.pt", "sub/b.pt", "c.pt"} and doc["engines"]["."]["zero_partitions"] == 2
    assert manifest.problems(str(root)) == []
    (root / "a.pt").write_bytes(b"a" * 10)
    (root / "sub" / "b.pt").write_bytes(b"B" * 20)  # same size, other bytes
    (root / "c.pt").unlink()
    (root / "universal").mkdir()  # a conversion cache added later is not part of the checkpoint
    found = manifest.problems(str(root))
    assert f"{root / 'a.pt'} has 10 bytes where 50 were written" in found
    assert any("sub/b.pt does not match its recorded CRC-32" in p for p in found)
    assert f"{root / 'c.pt'} is missing" in found and len(found) == 3
    assert manifest.problems(str(root), checksums=False) == sorted(p for p in found if "CRC" not in p)
    (root / manifest.MANIFEST).write_bytes(b"\x00garbage")
    assert "is damaged" in manifest.problems(str(root))[0]


def test_latest_garbage_missing_and_incomplete_are_sentences(tmp_path):
    make_checkpoint(tmp_path, "rollout1")
    make_checkpoint(tmp_path, "rollout2")
    assert ckpt.read_latest(str(tmp_path)) == ("rollout2", None)
    for content, words in ((b"\xff\x00junk", "is not a checkpoint tag"), (b"rollout9", "does not exist"),
                           (b"../etc", "is not a checkpoint tag")):
        (tmp_path / "latest").write_bytes(content)
        tag, problem = ckpt.read_latest(str(tmp_path))
        assert tag is None and words in problem
        assert ckpt.latest_complete_tag(str(tmp_path)) == "rollout2"
    make_checkpoint(tmp_path, "rollout3", commit=False)
    (tmp_path / "latest").write_text("rollout3")
    assert "no COMPLETE marker" in ckpt.read_latest(str(tmp_path))[1]
    assert ckpt.candidate_tags(str(tmp_path))[0] == ["rollout2", "rollout1"]


# ------------------------------------------------------------------------------ resume sources and refusals


def test_resume_accepts_run_dir_checkpoints_dir_and_tag_dir(tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    make_checkpoint(ckpts, "rollout1")
    make_checkpoint(ckpts, "rollout2")
    for given in (out, ckpts):
        folder, tags, explicit, _ = run_dir.classify(str(given), "unused")
        assert folder == str(ckpts) and tags == ["rollout2", "rollout1"] and explicit
    assert run_dir.classify(str(ckpts / "rollout1"), "unused")[:2] == (str(ckpts), ["rollout1"])
    with pytest.raises(ConfigError, match="no such directory"):
        run_dir.classify(str(tmp_path / "nope"), "unused")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        run_dir.classify(str(tmp_path / "empty"), "unused")
    make_checkpoint(ckpts, "rollout3", commit=False)
    with pytest.raises(ConfigError, match=r"has no COMPLETE marker.*--resume .*rollout2"):
        run_dir.classify(str(ckpts / "rollout3"), "unused")


def test_damaged_newest_explicit_fails_auto_falls_back_and_keeps_it(tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    make_checkpoint(ckpts, "rollout1")
    bad = make_checkpoint(ckpts, "rollout2") / "mp_rank_00_model_states.pt"
    bad.write_bytes(b"x" * 7)
    with pytest.raises(ConfigError, match=rf"{bad} has 7 bytes where 100.*--resume {ckpts / 'rollout1'}"):
        run_dir.choose(str(ckpts), ["rollout2"], explicit=True, checksums=True)
    run = run_dir.open_run_dir(run_cfg(out), checksums=True)
    try:
        assert run.resume.tag == "rollout1" and run.resume.layout["zero_partitions"] == 2
        assert any(f"{bad} has 7 bytes" in n and "falling back" in n for n in run.notes)
        assert (ckpts / "rollout2.damaged" / "mp_rank_00_model_states.pt").exists()
        assert not (ckpts / "rollout2.damaged" / ckpt.COMPLETE).exists()
    finally:
        run.release()


def test_fresh_start_or_foreign_or_older_resume_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    make_checkpoint(out / "checkpoints", "rollout1")
    make_checkpoint(out / "checkpoints", "rollout2")
    (out / "metrics.jsonl").write_text('{"event": "step"}\n')
    other = tmp_path / "other" / "checkpoints"
    make_checkpoint(other, "rollout5")
    cases = {"never": "a fresh start there", str(other): "resuming from", str(out / "checkpoints" / "rollout1"):
             "is older than this run's newest"}
    for resume, words in cases.items():
        with pytest.raises(ConfigError, match=words) as err:
            run_dir.open_run_dir(run_cfg(out, resume))
        assert "--overwrite" in str(err.value) and "--resume auto" in str(err.value)
        assert (out / "metrics.jsonl").exists() and (out / "checkpoints" / "rollout2").exists()
        assert not (out / ".dsrl.lock").exists()  # released on refusal
    run = run_dir.open_run_dir(run_cfg(out, str(out / "checkpoints" / "rollout1"), overwrite=True))
    run.release()
    assert run.resume.tag == "rollout1" and not (out / "checkpoints" / "rollout2").exists()
    run = run_dir.open_run_dir(run_cfg(out, "never", overwrite=True))
    run.release()
    assert run.resume is None and not (out / "metrics.jsonl").exists() and not os.listdir(out / "checkpoints")


def test_overwrite_with_resume_auto_starts_over(tmp_path):
    """--overwrite under the default --resume auto discards the run; it does not continue from its newest."""
    out = tmp_path / "run"
    make_checkpoint(out / "checkpoints", "rollout1")
    make_checkpoint(out / "checkpoints", "rollout2")
    (out / "metrics.jsonl").write_text('{"event": "step"}\n')
    run = run_dir.open_run_dir(run_cfg(out, "auto"))
    run.release()
    assert run.resume.tag == "rollout2"  # without --overwrite, auto continues
    run = run_dir.open_run_dir(run_cfg(out, "auto", overwrite=True))
    run.release()
    assert run.resume is None and not (out / "metrics.jsonl").exists() and not os.listdir(out / "checkpoints")


def test_output_dir_kinds_and_writability(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is an existing file, not a directory"):
        run_dir.prepare_directories(str(tmp_path / "afile"))
    (tmp_path / "o1").mkdir()
    (tmp_path / "o1" / "checkpoints").write_text("x")
    with pytest.raises(ConfigError, match="checkpoints is a file"):
        run_dir.prepare_directories(str(tmp_path / "o1"))
    (tmp_path / "o2" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(ConfigError, match="metrics.jsonl is a directory"):
        run_dir.prepare_directories(str(tmp_path / "o2"))


def test_free_space_warns_below_one_checkpoint_and_refuses_far_below(tmp_path, monkeypatch, caplog):
    model = torch.nn.Linear(1000, 1000)  # ~1M parameters: ~16 MiB checkpoint estimate (+4 MiB export)
    need = run_dir.estimate_checkpoint_bytes(model, with_export=True)
    assert need == 1_001_000 * 20
    run = run_dir.RunDir(str(tmp_path), str(tmp_path), None)
    usage = SimpleNamespace(total=2**40, used=0, free=need * 2)
    monkeypatch.setattr(run_dir.shutil, "disk_usage", lambda p: usage)
    run_dir.check_free_space(run, model, run_cfg(tmp_path))
    usage.free = int(need * 0.8)
    with caplog.at_level("WARNING", logger="dsrl.checkpoint.run_dir"):
        run_dir.check_free_space(run, model, run_cfg(tmp_path))
    assert "a checkpoint save will probably fail" in caplog.text
    usage.free = int(need * 0.4)
    with pytest.raises(ConfigError, match=r"has 7.6 MiB free; one checkpoint of this model needs about 19.1 MiB"):
        run_dir.check_free_space(run, model, run_cfg(tmp_path))


# ------------------------------------------------------------------------------ lock


def test_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path):
    first = OutputLock.acquire(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"in use by another job: pid {os.getpid()} on host {first.info['host']}"):
        OutputLock.acquire(str(tmp_path))
    first.release()
    assert not (tmp_path / ".dsrl.lock").exists()
    dead = {**first.info, "pid": 2**22 + 7}  # no such process
    (tmp_path / ".dsrl.lock").write_text(json.dumps(dead))
    second = OutputLock.acquire(str(tmp_path))
    assert "took over the stale lock" in second.taken_over and f"pid {dead['pid']}" in second.taken_over
    second.release()
    (tmp_path / ".dsrl.lock").write_text(json.dumps({**first.info, "host": "elsewhere-node-7"}))
    with pytest.raises(ConfigError, match=r"pid \d+ on host elsewhere-node-7.*If that job is gone.*delete"):
        OutputLock.acquire(str(tmp_path))


# ------------------------------------------------------------------------------ metrics


def test_resume_truncation_keeps_the_dropped_rows(tmp_path):
    rows = [{"event": "step", "rollout": r, "optimizer_step": s} for r, s in ((1, 1), (1, 2), (2, 3), (2, 4))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut')
    MetricsWriter(str(tmp_path), 0, resume_at=(1, 2)).close()
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
    dropped = (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()
    assert [json.loads(x)["optimizer_step"] for x in kept] == [1, 2]
    assert [json.loads(x)["optimizer_step"] for x in dropped[:2]] == [3, 4] and dropped[2] == '{"cut'


# ------------------------------------------------------------------------------ reward contract


def _reward(fn, timeout_s=None):
    return as_batched(fn, spec="my_rewards:score", timeout_s=timeout_s)


def test_reward_values_must_be_numbers_one_per_completion():
    args = (["p"] * 3, ["aa", "bb", "cc"], ["x"] * 3)
    assert _reward(lambda p, c, a: [1, np.float32(0.5), torch.tensor(2.0)])(*args) == [1.0, 0.5, 2.0]
    with pytest.raises(ConfigError, match=r"dsrl.data.reward_fn = 'my_rewards:score' returned 'good' \(str\) for "
                                          r"sample 1 of 3 \(completion 'bb'"):
        _reward(lambda p, c, a: [0.1, "good", 0.3])(*args)
    with pytest.raises(ConfigError, match=r"returned None \(NoneType\) for sample 0 of 3.*float\('nan'\) masks"):
        _reward(lambda p, c, a: [None] * 3)(*args)
    with pytest.raises(ConfigError, match=r"returned 2 rewards for 3 completions"):
        _reward(lambda p, c, a: [0.0, 1.0])(*args)
    with pytest.raises(ConfigError, match=r"returned 0.5 \(float\), not a list of numbers"):
        _reward(lambda p, c, a: 0.5)(*args)


def test_reward_timeout_masks_and_counts_even_if_the_function_swallows_it():
    def slow_on_bb(prompt, completion, answer):
        if completion == "bb":
            try:
                time.sleep(30)
            except Exception:  # a broad except in user code does not swallow the limit
                pass
        return 1.0

    fn = _reward(slow_on_bb, timeout_s=0.3)
    start = time.monotonic()
    out = fn(["p"] * 3, ["aa", "bb", "cc"], ["x"] * 3)
    assert time.monotonic() - start < 5
    assert out[0] == 1.0 and np.isnan(out[1]) and out[2] == 1.0
    assert fn.take_timeouts() == 1 and fn.take_timeouts() == 0
    batched = _reward(lambda p, c, a: time.sleep(30), timeout_s=0.3)
    assert all(np.isnan(v) for v in batched(["p"] * 4, ["a"] * 4, ["x"] * 4)) and batched.take_timeouts() == 4
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert all_timed_out(4, 4) and all_timed_out(3, 4) is None


def test_invalid_utf8_prompts_file_is_a_config_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "ab\xff\xfe", "answer": "x"}\n')
    with pytest.raises(ConfigError, match=r"dsrl.data.path = .*bad.jsonl' is not valid UTF-8.*Fix: re-encode"):
        load_prompts(DataConfig(task=None, path=str(path), reward_fn="m:f"), seed=0)


# ------------------------------------------------------------------------------ bounds, elastic, stop


def test_join_bound_applies_without_environment_variables(monkeypatch):
    import deepspeed

    from dsrl.backends.deepspeed import cpu_shm, engine
    from dsrl.core import launchers, rendezvous

    monkeypatch.delenv(timeouts.JOIN_TIMEOUT_ENV, raising=False)
    assert timeouts.join_timeout_s() == timeouts.DEFAULT_JOIN_TIMEOUT_S == 60.0
    monkeypatch.setenv(timeouts.JOIN_TIMEOUT_ENV, "12")
    assert timeouts.join_timeout_s() == 12.0 and timeouts.join_timeout_s(7) == 7.0
    monkeypatch.delenv(timeouts.JOIN_TIMEOUT_ENV)
    seen = {}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, {"WORLD_SIZE": "2", "LOCAL_SIZE": "1"}.get(key, "0"))
    monkeypatch.setattr(launchers, "_ADOPTED", [])
    monkeypatch.setattr(engine.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(rendezvous, "check_in", lambda launch, bound_s: seen.update(preflight=(launch, bound_s)))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(kw))
    monkeypatch.setattr(cpu_shm, "release_segments", lambda: None)
    engine.ensure_distributed()
    # The start-up preflight is bounded by a minute, and the process group is then built on its store.
    assert seen["preflight"][1] == 60.0 and seen["preflight"][0].world_size == 2
    assert seen["timeout"].total_seconds() == 60.0 and seen["init_method"] == "dsrl://"
    cfg = load_config(json.loads((Path(__file__).parents[2] / "configs" / "tiny_grpo_cpu.json").read_text()))
    assert cfg.dsrl.run.join_timeout_s is None and cfg.dsrl.run.collective_timeout_s == 1800.0


def test_reward_timeout_must_stay_below_the_collective_bound():
    raw = json.loads((Path(__file__).parents[2] / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["dsrl"]["run"]["collective_timeout_s"] = 60
    with pytest.raises(ConfigError, match="reward_timeout_s = 600.0 is not below dsrl.run.collective_timeout_s"):
        load_config(raw)


def test_elastic_layout_rules(tmp_path):
    a = Layout(zero_stage=2, zero_partitions=2, data_parallel_size=2)
    assert needs_universal(a, Layout(2, 1, 1)) and not needs_universal(Layout(0, 2, 2), Layout(0, 1, 1))
    with pytest.raises(ConfigError, match="tensor_parallel_size = 1, this run has 2"):
        check_compatible(a, Layout(2, 1, 1, tensor_parallel_size=2), "ck")
    with pytest.raises(ConfigError, match="ZeRO stage 2, this run uses stage 3"):
        check_compatible(a, Layout(3, 2, 2), "ck")
    legacy = tmp_path / "old"
    legacy.mkdir()
    for r in range(4):
        (legacy / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    old = saved_layout(str(legacy))  # before manifests: the partition count is all the files tell
    assert old == Layout(zero_stage=-1, zero_partitions=4, data_parallel_size=4, tensor_parallel_size=0,
                         sequence_parallel_size=0)
    check_compatible(old, Layout(1, 4, 4, tensor_parallel_size=2), "ck")  # unknowns are not compared
    assert needs_universal(old, Layout(3, 2, 2)) and not needs_universal(old, Layout(1, 4, 4))


def test_stop_decisions(monkeypatch):
    stop = StopControl(grace_s=10)
    stop.begin_training()
    assert stop.decide(3) is None
    monkeypatch.setattr(stop, "_expire", lambda: None)
    stop.request("SIGTERM received", signal.SIGTERM)
    stop.note_step(1.0)
    assert stop.decide(3) == "finish" and stop.decide(100) == "finish"  # once agreed it stays
    late = StopControl(grace_s=10)
    late.begin_training()
    monkeypatch.setattr(late, "_expire", lambda: None)
    late.request("SIGTERM received", signal.SIGTERM)
    late.note_step(2.0)
    assert late.decide(50) == "stop" and late.exit_code == 143
    assert _looks_like_launcher(["python", "-m", "deepspeed.launcher.launch", "--world_info=x"])
    assert _looks_like_launcher(["/usr/bin/python", "/usr/local/bin/deepspeed", "train.py"])
    assert not _looks_like_launcher(["bash", "-c", "python train.py"])


@pytest.mark.parametrize("hand_over", [True, False])
def test_a_sigterm_after_the_run_does_not_silence_the_ranks_last_word(hand_over):
    """The launcher SIGTERMs a rank as soon as another one exited; once the run is over (its stop control
    uninstalled), the entry point's handler keeps the rank alive to print its message (False: the default handler
    the control found, which ends it silently: the guard's planted failure). In a forked child."""
    import launch.train as entry

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a rank whose run just ended
        code = 3
        try:
            os.close(read)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            stop = StopControl(grace_s=10)
            stop.install()
            stop.begin_training()
            if hand_over:
                stop.restore_to({signal.SIGTERM: entry._ending})  # as launch/train.py does once the trainer exists
            stop.end_run()
            stop.uninstall()  # the run is over; its last word is not printed yet
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, because another rank exited first
            time.sleep(0.1)
            os.write(write, b"dsrl: error: generator 0 (rank 2 on host a) has ended")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    assert ("generator 0 (rank 2 on host a)" in said) == hand_over, (status, said)
    assert os.waitstatus_to_exitcode(status) == (0 if hand_over else -signal.SIGTERM), status


def test_universal_conversion_sees_only_the_engine_s_own_files(tmp_path):
    """A policy checkpoint holds its critic in a sub-directory; DeepSpeed's converter walks directories
    recursively and took the critic's model-state file for a second model-parallel rank (found on a
    2 -> 1 PPO resume). The converter is given the engine's own files only."""
    from dsrl.checkpoint.elastic import _engine_files_only

    tag = tmp_path / "rollout2"
    (tag / "critic").mkdir(parents=True)
    (tag / "hf").mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "COMPLETE"):
        (tag / name).write_text(name)
    (tag / "critic" / "mp_rank_00_model_states.pt").write_text("critic")
    with _engine_files_only(str(tag)) as source:
        seen = sorted(os.path.relpath(os.path.join(r, f), source) for r, _, fs in os.walk(source) for f in fs)
        assert seen == ["COMPLETE", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
        assert Path(source, "mp_rank_00_model_states.pt").read_text() == "mp_rank_00_model_states.pt"
    assert not os.path.exists(source)  # the staging directory is gone
    with _engine_files_only(str(tag / "critic")) as source:
        assert source == str(tag / "critic")  # nothing nested: converted in place


def test_config_errors_of_a_startup_check_are_agreed():
    """dsrl.core.collectives.agree (one process): the rank's own error comes back marked agreed only through the
    shared error of several ranks (launch/train.py prints an agreed error from rank 0 only); no error passes. The
    2-rank jobs: tests/distributed/test_trainer.py::test_a_configuration_error_is_printed_by_one_rank."""
    from dsrl.core.collectives import agree, outcome, shared_error
    from dsrl.core.errors import RunError

    assert ConfigError("x").agreed is False
    agree(None)
    shared = shared_error([None, outcome(ConfigError("dsrl.batch.x is wrong")), outcome(RunError("r"))])
    assert isinstance(shared, ConfigError) and shared.agreed and str(shared) == "dsrl.batch.x is wrong"
    assert shared_error([None, None]) is None
    with pytest.raises(ConfigError, match="dsrl.batch.x is wrong"):
        agree(ConfigError("dsrl.batch.x is wrong"))
