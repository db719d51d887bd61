"""LoRA on 2 CPU ranks (``dsrl.model.lora``, docs/lora.md): exactness of the adapters' update, the KL reference
for free, generation through the adapted model, merged weights, bitwise and elastic resume, and both exports."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import EXTENDED, REPO, launch, one_rank, write_json

pytest.importorskip("peft", reason="PEFT is not installed (in the dsrl checkout: pip install -e '.[lora]')")

TOL = 1e-6
ROLLOUTS = 3


def test_adapters_update_exact_on_every_stage_and_mode(tmp_path):
    """dsrl.check on a run file with dsrl.model.lora: the check's tiny Qwen2 carries the run's adapters (B drawn
    at random so A gets a gradient too); on ZeRO 0-3, every loss aggregation, uneven and padding-only splits, the
    applied update of the adapters equals the float64 reference of the same PEFT model (<= 1e-6), the frozen base
    weights do not move at all, and the naive per-micro-batch mean fails on the same data (the check can fail)."""
    run = write_json(tmp_path / "run.json", {
        "zero_optimization": {"stage": 0},
        "dsrl": {"batch": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "mini_batch_size": 8,
                           "micro_batch_size_per_rank": 1}, "run": {"rollouts": 1},
                 "model": {"lora": {"r": 4, "alpha": 8.0}}},
    })
    out = tmp_path / "results.json"
    proc = launch(["--module", "dsrl.check", "--ds_config", str(run), "--zero_stages", "0,1,2,3", "--splits",
                   "uneven,pad_rank", "--method", "dsrl,naive", "--json", str(out)], nprocs=2, timeout=900)
    assert "qwen2+lora" in proc.stdout
    results = json.loads(out.read_text())["results"]
    exact = [r for r in results if r["method"] == "dsrl"]
    assert len(exact) == 4 * 4 * 2 and all(r["lora"] and r["world_size"] == 2 for r in results)
    assert {r["logprob_head"] for r in results} == {"fused"}  # the head under PEFT, fused into the log-softmax
    worst = max(exact, key=lambda r: r["error"])
    assert worst["error"] <= TOL and max(r["adapter_error"] for r in exact) <= TOL, worst
    assert all(r["frozen_moved"] == 0.0 for r in results)  # the base never moves, whatever the step does
    assert all(r["error"] > 1e-2 for r in results if r["method"] == "naive")
    assert len({r["trainable_parameters"] for r in results}) == 1 and exact[0]["trainable_parameters"] > 0


@EXTENDED
def test_reference_generation_and_merged_weights_on_every_stage(tmp_path):
    """tests/workers/lora_worker.py on ZeRO 0-3 with uneven work per rank: the KL reference (the policy engine with
    its adapters disabled) equals a frozen base copy bitwise and the adapters are on again after it; greedy hf and
    cb generation through the engine equal a plain PEFT copy's; a step moves the adapters only; the merged weights
    (computed inside the ZeRO-3 gather, as vLLM's sync takes them) load into a plain transformers model that gives
    the engine's log-probs (float32 rounding) and greedy output."""
    out = tmp_path / "report.json"
    launch(["tests/workers/lora_worker.py", "--out", str(out), "--stages", "0,1,2,3"], nprocs=2, timeout=600,
           env={"PYTHONPATH": str(REPO)})
    reports = [s for rank in json.loads(out.read_text()) for s in rank]
    assert sorted((r["rank"], r["stage"]) for r in reports) == [(k, s) for k in (0, 1) for s in (0, 1, 2, 3)]
    for r in reports:
        assert r["trainable_are_adapters"] and r["trainable"] > 0, r
        assert r["reference_vs_frozen_copy"] == 0.0 and r["reference_vs_policy"] > 1e-2, r
        assert r["policy_restored"] and r["adapters_trainable_after"], r
        assert r["hf_equal"] and r["cb_equal"], r
        assert r["step_applied"] and r["base_unchanged"] and r["adapters_moved"] == r["trainable"], r
        assert r["merged_names_plain"] and r["merged_has_lm_head"] and r["merged_greedy_equal"], r
        assert r["merged_logprob_diff"] < 1e-5, r


def _run_file(tmp_path) -> str:
    raw = json.loads((REPO / "configs" / "tiny_grpo_lora_cpu.json").read_text())
    raw["zero_optimization"] = {"stage": 3}
    raw["scheduler"]["params"]["warmup_num_steps"] = 2
    raw.pop("csv_monitor", None)
    raw["dsrl"]["batch"].update(prompts_per_rollout=8, samples_per_prompt=4, mini_batch_size=16)
    raw["dsrl"]["run"].update(rollouts=ROLLOUTS, save_every=1, keep_last=3)
    raw["dsrl"]["sft"] = {"steps": 4}  # the warm-up trains the adapters too
    raw["dsrl"]["algorithm"]["kl_coef"] = 0.05  # the reference: the policy engine with its adapters disabled
    return str(write_json(tmp_path / "run.json", raw))


def _steps(out) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] in ("sft", "step")]


@EXTENDED
def test_resume_bitwise_elastic_resume_and_exports(tmp_path):
    """ZeRO-3, KL against the adapters-disabled reference: a run stopped after rollout 1 and resumed on 2 ranks
    repeats the uninterrupted run bitwise (every loss, KL and the final weights); a copy of the stopped run resumed
    on 1 rank (DeepSpeed's universal checkpoint) holds the checkpoint's weights, frozen base included; the final
    model exports merged (transformers) and as an adapter (PEFT on the rebuilt base), both reproducing the trained
    engine's logits."""
    from dsrl.checkpoint.export import consolidated_state_dict

    worker = "tests/workers/reliability_worker.py"
    config = _run_file(tmp_path)
    whole, parts, elastic = tmp_path / "whole", tmp_path / "parts", tmp_path / "elastic"
    common = [worker, "--ds_config", config, "--dsrl.run.progress_bar", "false"]
    launch([*common, "--dsrl.run.output_dir", str(whole), "--dump_logits", str(tmp_path / "logits.pt")], nprocs=2)
    launch([*common, "--dsrl.run.output_dir", str(parts), "--dsrl.run.stop_after_rollouts", "1"], nprocs=2)
    shutil.copytree(parts, elastic)
    launch([*common, "--dsrl.run.output_dir", str(parts), "--resume", "auto"], nprocs=2)
    got, want = _steps(parts), _steps(whole)
    assert len(want) == 4 + ROLLOUTS * 2 and all("kl" in s for s in want if s["event"] == "step")
    assert any(s["kl"] > 0 for s in want if s["event"] == "step")  # the adapters moved away from the base
    assert [(s.get("loss"), s.get("kl")) for s in got] == [(s.get("loss"), s.get("kl")) for s in want]
    tag = f"rollout{ROLLOUTS}"
    a = consolidated_state_dict(str(parts / "checkpoints" / tag))
    b = consolidated_state_dict(str(whole / "checkpoints" / tag))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(".lora_A." in k for k in a) and any(".base_layer." in k for k in a)

    proc = one_rank([*common, "--dsrl.run.output_dir", str(elastic), "--resume", "auto",
                     "--dsrl.run.stop_after_rollouts", "1", "--dump_resumed", str(tmp_path / "resumed.pt")])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert "this run has 1" in (resumed["notice"] or "")
    saved = consolidated_state_dict(str(elastic / "checkpoints" / "rollout1"))
    assert set(resumed["params"]) <= set(saved) and any(".base_layer." in k for k in resumed["params"])
    assert all(torch.equal(resumed["params"][k], saved[k]) for k in resumed["params"])

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dsrl.cli.main import main as dsrl_cli
    from dsrl.config import ModelConfig, load_config
    from dsrl.rl.policy.model import build_model
    from dsrl.rl.policy.tokenizer import load_tokenizer

    probe = torch.load(tmp_path / "logits.pt", weights_only=False)

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(input_ids=probe["input_ids"], use_cache=False).logits

    def rel(x: torch.Tensor) -> float:
        return ((x - probe["logits"]).abs().max() / probe["logits"].abs().max()).item()

    merged = AutoModelForCausalLM.from_pretrained(whole / "final_model", local_files_only=True, dtype=torch.float32)
    assert not any("lora" in n for n in merged.state_dict()) and rel(logits(merged)) <= 1e-5
    adapter_dir = tmp_path / "adapter"
    assert dsrl_cli(["export", str(whole), "--out", str(adapter_dir), "--adapter"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                                                      adapter_dir.iterdir()}
    cfg = load_config(config).dsrl
    tok = load_tokenizer(cfg.model)
    base = build_model(ModelConfig(**{**cfg.model.model_dump(), "lora": None}), len(tok), tok.pad_token_id,
                       tok.bos_token_id, tok.eos_token_id, on_gpu=False, seed=cfg.run.seed)
    adapted = PeftModel.from_pretrained(base, adapter_dir)
    assert rel(logits(adapted)) <= 1e-6


@EXTENDED
def test_resume_with_model_lora_changed_is_refused_naming_it(tmp_path):
    """A LoRA run resumed without dsrl.model.lora (or with other adapters), and a full run resumed with it added:
    refused before any model is built (status 2), one sentence naming dsrl.model.lora, the saved setting and the
    ways forward. It used to end in DeepSpeed's state-dict error (a key dump, status 1) advising an earlier
    checkpoint. A checkpoint written before the manifest recorded the adapters is recognised by its hf/ folder."""
    raw = json.loads((REPO / "configs" / "tiny_grpo_lora_cpu.json").read_text())
    raw.pop("csv_monitor", None)
    raw["scheduler"]["params"]["warmup_num_steps"] = 1
    raw["dsrl"]["batch"].update(prompts_per_rollout=4, samples_per_prompt=4, mini_batch_size=16)
    raw["dsrl"]["run"].update(rollouts=2, export_final=False, progress_bar=False)
    raw["dsrl"]["sft"] = {"steps": 0}
    config = str(write_json(tmp_path / "run.json", raw))

    def train(out, *extra: str):
        return one_rank(["launch/train.py", "--ds_config", config, "--dsrl.run.output_dir", str(out), *extra])

    def refused(proc, *words: str) -> None:
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = [x for x in proc.stderr.splitlines() if x.startswith("dsrl: configuration error:")]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        for w in words:
            assert w in lines[0], lines[0]

    lora_run, full_run = tmp_path / "lora", tmp_path / "full"
    for out, extra in ((lora_run, []), (full_run, ["--dsrl.model.lora", "null"])):
        proc = train(out, "--dsrl.run.stop_after_rollouts", "1", *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = lora_run / "checkpoints" / "rollout1"
    ways = ("Fix: set dsrl.model.lora as it was saved to continue the run", f"dsrl export {saved} --out DIR")
    refused(train(lora_run, "--dsrl.model.lora", "null"), "dsrl.model.lora is not set, but checkpoint", str(saved),
            'trained with LoRA adapters (dsrl.model.lora = {r: 8, alpha: 16.0, target_modules: "all-linear"', *ways)
    refused(train(lora_run, "--dsrl.model.lora.r", "4"), "dsrl.model.lora.r = 4 where it was 8")
    refused(train(full_run), "dsrl.model.lora is set, but checkpoint", "was trained without it",
            "Fix: remove dsrl.model.lora to continue the run")
    # A checkpoint from before the record: hf/ holds PEFT's adapter config exactly when adapters were on.
    manifest = saved / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    del doc["model"]
    manifest.write_text(json.dumps(doc))
    refused(train(lora_run, "--dsrl.model.lora", "null"), "trained with LoRA adapters (dsrl.model.lora):")
    assert train(lora_run, "--dsrl.model.lora.dropout", "0.1").returncode == 0  # dropout may change: it continues
