"""One build of the rollout side (dsrl.rl.policy.rollout_side) for colocated, trainer and generator ranks.

- a trainer's and a generator's builds are the same model, LoRA structure and parameter flags included, so the
  trainers' published state_dict lands in the generator's tensors name for name;
- a generator's behavior log-probs equal those of the trainer's own module bit for bit; with the weights frozen
  (what the generator did before) they do not (planted): ATen picks another kernel for the output head;
- the backend's arguments have one formula, and ``vllm`` is refused before any work with the install hint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dsrl.config import ConfigError, load_config
from dsrl.rl.policy.rollout_side import RolloutSide, RolloutSideSettings

CONFIGS = Path(__file__).parents[2] / "configs"


def _cfg(name: str = "tiny_grpo_async_cpu.json", **rollout):
    raw = json.loads((CONFIGS / name).read_text())
    raw["dsrl"]["rollout"].update(rollout)
    return load_config(raw)


def _side(cfg, generator: bool = False) -> RolloutSide:
    side = RolloutSide(RolloutSideSettings.of(cfg.dsrl), on_gpu=False)
    side.build_model()
    if generator:
        side.on_generator_device()
    return side


@pytest.mark.parametrize("name", ["tiny_grpo_async_cpu.json", "tiny_grpo_lora_cpu.json"])
def test_trainer_and_generator_build_the_same_model(name):
    cfg = _cfg(name)
    trainer, generator = _side(cfg), _side(cfg, generator=True)
    a, b = trainer.weights().state_dict(), generator.weights().state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    flags = [(n, p.requires_grad, p.dtype) for n, p in trainer.weights().named_parameters()]
    assert flags == [(n, p.requires_grad, p.dtype) for n, p in generator.weights().named_parameters()]
    if "lora" in name:  # the adapters have a place to go on the generator, and only they train
        assert any("lora_A" in k for k in b) and "model.embed_tokens.weight" in b
        assert {n for n, g, _ in flags if g} == {n for n, _, _ in flags if "lora_" in n}


@pytest.mark.parametrize("planted", [False, True])
def test_generator_behavior_logprobs_equal_the_trainer_modules(planted):
    cfg = _cfg()
    trainer, generator = _side(cfg), _side(cfg, generator=True)
    if planted:  # the generator as it was built before: frozen weights
        generator.model.requires_grad_(False)
    tok = trainer.tokenizer
    prompts = [tok("abcdef")["input_ids"], tok("ba")["input_ids"], tok("cabbage")["input_ids"]]
    want = trainer.backend(trainer.model, len(prompts)).generate(prompts, 4, seed=3)
    got = generator.backend(generator.model, len(prompts)).generate(prompts, 4, seed=3)
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
    same = [c.behavior_logprobs for c in got] == [c.behavior_logprobs for c in want]
    assert same != planted


def test_backend_arguments_have_one_formula_and_vllm_is_refused_before_work(monkeypatch):
    d = _cfg(backend="vllm").dsrl
    side = RolloutSide(RolloutSideSettings.of(d), on_gpu=False)
    assert side.backend_kwargs(4) == {"max_model_len": d.max_generation_tokens,
                                      "samples_per_prompt": d.batch.samples_per_prompt, "seed": d.run.seed,
                                      "sleep_level": d.memory.vllm_sleep_level, "bucket_bytes": 512 * 2**20}
    d = _cfg().dsrl
    local = RolloutSide(RolloutSideSettings.of(d), on_gpu=False)
    bounds = local.backend_kwargs(4)["bounds"]  # continuous batching: the run's largest call
    g, longest = d.batch.samples_per_prompt, d.max_generation_tokens
    assert (bounds.sequences, bounds.sequence_tokens) == (min(4, d.rollout.generation_batch_size) * g, longest)
    side.build_model()
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    monkeypatch.setattr("dsrl.rollout.vllm.installed_vllm_builds", lambda: [])
    with pytest.raises(ConfigError, match=r"rollout.backend = 'vllm' needs vLLM, which is not installed. Fix: in "
                                              r"the dsrl checkout, pip"):
        side.check()
    RolloutSide(RolloutSideSettings.of(_cfg().dsrl), on_gpu=False).check()  # hf: nothing to refuse
