"""DeepSpeed AutoTP (``tensor_parallel.autotp_size``) and AutoEP (``expert_parallel``) under dsrl, on CPU ranks.

- exactness (``dsrl.check``, a tiny Llama sharded by AutoTP, float64 unsharded reference, uneven
  micro-batches): TP=2 x DP=1 on ZeRO-0/1/2/3 and TP=2 x DP=2 (4 ranks) on ZeRO-2/3, all four loss_agg
  modes, relative error <= 1e-6; the guard: dsrl's own step with the counts summed over the whole
  world (tensor peers counted as replicas) gives exactly half the gradient; log-probs from the fused
  output head (tied: replicated; untied: AutoTP's vocabulary-parallel head, on ZeRO-1/3);
- MoE: a tiny Mixtral with DeepSpeed's expert parallelism (2 experts per rank) on ZeRO-1/2/3, dense
  and expert parameters both exact; the same model without expert parallelism too;
- generation: tensor peers generate identical completions (equal to the unsharded model's), and stay
  in lockstep even when their sampling diverges (synchronized stop);
- the main job: ``launch/train.py`` with configs/tiny_grpo_autotp_cpu.json (AutoTP 2, ZeRO-3) learns
  the built-in task, and resuming from its mid-run checkpoint (AutoTP shards included) reproduces
  the rest of the run bitwise; with a KL reference (sharded like the policy) too.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import EXTENDED, REPO, launch, write_json

TOL = 1e-6
PAD, EOS = 0, 2  # tests/workers/autotp_rollout_worker.py
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _run_file(tmp_path, **sections) -> str:
    return str(write_json(tmp_path / "run.json", {
        "zero_optimization": {"stage": 0}, **sections,
        "dsrl": {"batch": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "mini_batch_size": 8,
                           "micro_batch_size_per_rank": 1}, "run": {"rollouts": 1}},
    }))


def _check(tmp_path, nprocs: int, run_file: str, *args: str) -> list[dict]:
    out = tmp_path / "results.json"
    proc = launch(["--module", "dsrl.check", "--ds_config", run_file, "--json", str(out), *args], nprocs=nprocs,
                  timeout=900)
    summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("max relative gradient error:")]
    assert len(summary) == 1, proc.stdout[-3000:]
    return json.loads(out.read_text())["results"]


def _assert_exact(results: list[dict], stages: set[int], replicas: int, modes: tuple[str, ...] = MODES,
                  model: str = "llama", head: str = "fused") -> None:
    exact = [r for r in results if r["method"] == "dsrl"]
    assert {(r["stage"], r["loss_agg"]) for r in exact} == {(s, m) for s in stages for m in modes}
    assert all(r["tensor_parallel_size"] == 2 and r["replicas"] == replicas and r["model"] == model for r in exact)
    assert {r["logprob_head"] for r in results} == {head}  # dsrl.rl.policy.logprobs: the head fused in
    worst = max(exact, key=lambda r: r["error"])
    assert worst["error"] <= TOL, worst


def test_autotp_tp2_dp1_exact_on_zero0123_and_world_count_halves(tmp_path):
    results = _check(tmp_path, 2, _run_file(tmp_path, tensor_parallel={"autotp_size": 2}),
                     "--zero_stages", "0,1,2,3", "--splits", "uneven", "--method", "dsrl,world_count")
    _assert_exact(results, {0, 1, 2, 3}, replicas=1)
    # The guard: counting over the whole world (TP peers included) doubles N_M and S_M -> half the gradient.
    # seq-mean-token-sum-norm divides by the planned B and L_norm, no count: unaffected.
    for r in results:
        if r["method"] == "world_count":
            want = 1.0 if r["loss_agg"] == "seq-mean-token-sum-norm" else 0.5
            assert abs(r["ratio"] - want) < 1e-6, r


def test_autotp_tp2_dp2_exact_on_zero23(tmp_path):
    """4 ranks = 2 replicas x 2 tensor peers; pad_rank: uneven micro-batch counts and a replica holding
    only padding."""
    results = _check(tmp_path, 4, _run_file(tmp_path, tensor_parallel={"autotp_size": 2}),
                     "--zero_stages", "2,3", "--splits", "pad_rank")
    _assert_exact(results, {2, 3}, replicas=2)
    assert {r["world_size"] for r in results} == {4}


def test_autotp_untied_vocab_parallel_head_exact(tmp_path):
    """An untied output head under AutoTP is column-parallel (each rank holds a slice of the vocabulary): dsrl's
    log-probs and entropy use the slice directly (log-sum-exp and the target's logit all-reduced over the tensor
    group, dsrl.backends.deepspeed.autotp.vocab_shard_of) instead of gathering the logits; exact on ZeRO-1/3."""
    modes = ("token-mean", "seq-mean-token-sum")
    results = _check(tmp_path, 2, _run_file(tmp_path, tensor_parallel={"autotp_size": 2}), "--model", "llama_untied",
                     "--zero_stages", "1,3", "--splits", "uneven", "--loss_agg", ",".join(modes))
    _assert_exact(results, {1, 3}, replicas=1, modes=modes, model="llama_untied", head="fused vocab-parallel")


def test_moe_expert_parallel_exact_dense_and_experts(tmp_path):
    """A tiny Mixtral, 4 experts split 2 + 2 over the ranks by AutoEP (all-to-all), ZeRO-1/2/3."""
    results = _check(tmp_path, 2, _run_file(tmp_path, expert_parallel={"enabled": True, "autoep_size": 2}),
                     "--zero_stages", "1,2,3", "--splits", "uneven", "--loss_agg", "token-mean,seq-mean-token-mean",
                     "--method", "dsrl,naive")
    for r in results:
        assert r["model"] == "mixtral" and r["expert_parallel_size"] == 2 and r["expert_parallel_layers"] == 1, r
        if r["method"] == "dsrl":
            assert r["dense_error"] <= TOL and r["expert_error"] <= TOL, r
        else:
            assert r["dense_error"] > 1e-2 and r["expert_error"] > 1e-2, r  # the check can fail on both kinds
    assert {r["stage"] for r in results} == {1, 2, 3}


def test_moe_without_expert_parallelism_exact(tmp_path):
    results = _check(tmp_path, 2, _run_file(tmp_path), "--model", "mixtral", "--zero_stages", "2",
                     "--splits", "uneven")
    assert len(results) == 4 and all(r["expert_parallel_layers"] == 0 for r in results)
    assert max(max(r["dense_error"], r["expert_error"]) for r in results) <= TOL, results


@EXTENDED
def test_generation_tensor_peers_identical_and_in_lockstep(tmp_path):
    out = tmp_path / "report.json"
    launch(["tests/workers/autotp_rollout_worker.py", "--out", str(out), "--stages", "1,3"], nprocs=2, timeout=300)
    peers = json.loads(out.read_text())
    for stage in ("1", "3"):
        a, b = (p["stages"][stage] for p in peers)
        assert a["view"]["tensor_rank"] == 0 and b["view"]["tensor_rank"] == 1
        assert a["view"]["replica"] == b["view"]["replica"] == 0 and a["view"]["count_group_size"] == 1
        # Same prompts and seed: identical completions, equal to the unsharded model's; some rows end early.
        assert a["same_seed"]["completions"] == b["same_seed"]["completions"]
        assert a["same_seed"]["equals_plain"] and b["same_seed"]["equals_plain"]
        assert 0 < sum(a["same_seed"]["finished"]) < len(a["same_seed"]["finished"])
        assert a["same_seed"]["collectives"] == b["same_seed"]["collectives"] > 0
        # Different seeds on the two peers: different tokens, yet the same number of sharded forwards (no hang),
        # and a row ends on both peers at the step where either produced eos (the other gets padding after it).
        da, db = a["divergent"], b["divergent"]
        assert da["completions"] != db["completions"] and da["collectives"] == db["collectives"]
        cut = 0
        for x, y in zip(da["completions"], db["completions"]):
            short, long = sorted((x, y), key=len)
            if len(short) < len(long):
                cut += 1
                assert short[-1] == EOS and set(long[len(short):]) == {PAD}, (x, y)
        assert cut > 0  # some row ended on one peer's eos only
        assert a["train_step_applied"] and b["train_step_applied"]


@EXTENDED
def test_kl_reference_under_autotp_zero3(tmp_path):
    """The frozen KL reference is an optimizer-less ZeRO-3 engine, AutoTP-sharded like the policy (an engine
    without the tensor_parallel section fails: AutoTP's groups are global)."""
    raw = json.loads((REPO / "configs" / "tiny_grpo_autotp_cpu.json").read_text())
    raw["scheduler"]["params"]["warmup_num_steps"] = 1  # 2 rollouts x 2 steps
    out = tmp_path / "out"
    launch(["launch/train.py", "--ds_config", str(write_json(tmp_path / "run.json", raw)), "--dsrl.run.rollouts", "2",
            "--dsrl.algorithm.kl_coef", "0.05", "--dsrl.algorithm.kl_estimator", "k3", "--dsrl.run.output_dir",
            str(out), "--dsrl.run.progress_bar", "false", "--dsrl.run.save_final", "false"], nprocs=2, timeout=600)
    kls = [s["kl"] for s in _rows(out, "step")]
    assert len(kls) == 4 and abs(kls[0]) < 1e-6  # the policy equals the reference before the first update
    assert all(k >= 0 for k in kls) and kls[-1] > 0


ROLLOUTS, SAVE_EVERY = 40, 8  # checkpoints at 8, 16, ...; keep_last 2 leaves 32 and 40


def _train(out, *extra: str) -> None:
    launch(["launch/train.py", "--ds_config", "configs/tiny_grpo_autotp_cpu.json", "--dsrl.run.rollouts", str(ROLLOUTS),
            "--dsrl.run.save_every", str(SAVE_EVERY), "--dsrl.run.output_dir", str(out),
            "--dsrl.run.progress_bar", "false", *extra], nprocs=2, timeout=900)


def _rows(out, event: str) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == event]


def _tensors(node, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a (nested) checkpoint structure, by its path."""
    if torch.is_tensor(node):
        return {path: node}
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else ()
    return {k: v for key, child in items for k, v in _tensors(child, f"{path}/{key}").items()}


def _final_state(out) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of every DeepSpeed file of the final checkpoint (ZeRO-3: one model and one optimizer file
    per tensor shard, holding the fp32 partitions and Adam moments)."""
    tag = out / "checkpoints" / f"rollout{ROLLOUTS}"
    files = sorted(tag.glob("*_states.pt"))
    return {f.name: _tensors(torch.load(f, map_location="cpu", weights_only=False)) for f in files}


@pytest.fixture(scope="module")
def autotp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("autotp") / "run"
    _train(out)
    return out


@EXTENDED
def test_main_job_under_autotp_learns(autotp_run):
    rewards = [r["reward_mean"] for r in _rows(autotp_run, "rollout")]
    assert len(rewards) == ROLLOUTS
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last - first > 0.05, (first, last, rewards)
    # One replica of two tensor peers: every rollout counts its P*G samples once, not once per peer.
    raw = json.loads((REPO / "configs" / "tiny_grpo_autotp_cpu.json").read_text())
    b = raw["dsrl"]["batch"]
    assert all(r["episodes"] == r["rollout"] * b["prompts_per_rollout"] * b["samples_per_prompt"]
               for r in _rows(autotp_run, "rollout"))
    steps = _rows(autotp_run, "step")
    assert len(steps) == ROLLOUTS * b["prompts_per_rollout"] * b["samples_per_prompt"] // b["mini_batch_size"]


@EXTENDED
def test_resume_under_autotp_is_bitwise(autotp_run, tmp_path):
    """Resume from a late checkpoint of that run (ZeRO-3 partitions of both AutoTP shards, the schedule, the
    sampler, the RNG) in a fresh output dir: the rest of the run reproduces the uninterrupted run's losses and
    final state (model and optimizer files of both tensor shards) bitwise."""
    start = ROLLOUTS - SAVE_EVERY
    out = tmp_path / "resumed"
    shutil.copytree(autotp_run / "checkpoints" / f"rollout{start}", out / "checkpoints" / f"rollout{start}")
    _train(out)
    got = [(s["optimizer_step"], s["loss"]) for s in _rows(out, "step")]
    steps = _rows(autotp_run, "step")
    want = [(s["optimizer_step"], s["loss"]) for s in steps][len(steps) * start // ROLLOUTS:]
    assert got == want and len(got) > 0
    a, b = _final_state(out), _final_state(autotp_run)
    assert sorted(a) == sorted(b) == [f"zero_pp_rank_0_mp_rank_0{tp}_{kind}_states.pt" for tp in (0, 1)
                                      for kind in ("model", "optim")]
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    assert sum(t.numel() for t in a["zero_pp_rank_0_mp_rank_01_optim_states.pt"].values()) > 10_000
