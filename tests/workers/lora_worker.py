"""Multi-process worker for tests/distributed/test_lora.py (run with ``deepspeed --num_gpus N``).

For each ZeRO stage of ``--stages``: builds the tiny Qwen2 policy with LoRA adapters (``dsrl.model.lora``, B drawn
at random so the adapted model differs from its base) and, from the same seed, a plain copy of the base model;
wraps the policy in an RLEngine and checks, with *uneven* work per rank (rank r: 3 - 2r micro-batches):

- reference: the KL reference log-probs of :class:`dsrl.rl.policy.lora.AdaptersDisabled` (the policy engine, adapters
  off) against those of a frozen base copy placed as the trainer places it (:func:`frozen_engine`), and the
  policy's own log-probs before and after (the adapters are on again);
- generation: the engine's greedy ``hf`` and ``cb`` completions against a plain PEFT copy's ``hf`` ones;
- a training step moves the adapters only (the frozen base weights are bit-identical after it);
- merged weights: :func:`dsrl.rollout.policy.generation_weights` of the trained engine (inside the ZeRO-3 gather,
  as vLLM's sync takes them) loaded into a plain transformers model give the engine's logits and greedy output.

Rank 0 writes one JSON report per rank and stage.
"""

from __future__ import annotations

import argparse
import json
import types
from typing import Any

import torch
import torch.distributed as dist

VOCAB, PAD, BOS, EOS = 32, 0, 1, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default="0,2,3")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    from dsrl.backends.deepspeed.engine import ensure_distributed

    ensure_distributed()
    reports = [run_stage(int(s)) for s in args.stages.split(",")]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, reports)
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(gathered, f, indent=1)
    dist.barrier()


def run_stage(stage: int) -> dict[str, Any]:
    import dsrl
    from dsrl.backends.deepspeed.frozen import equal_forwards, frozen_engine
    from dsrl.cli.check import full_parameters
    from dsrl.config import LoraConfig, ModelConfig, RolloutConfig
    from dsrl.core.logprobs import token_logprobs
    from dsrl.rl.policy.lora import AdaptersDisabled
    from dsrl.rl.policy.model import build_model, forward_logits, frozen_copy
    from dsrl.rollout.cb import ContinuousBatchingBackend
    from dsrl.rollout.hf import HFRolloutBackend
    from dsrl.rollout.policy import gathered_for_generation, generation_weights, unwrap

    rank, world = dist.get_rank(), dist.get_world_size()
    lora = LoraConfig(r=4, alpha=8.0)
    base = frozen_copy(build_model(ModelConfig(arch="qwen2"), VOCAB, PAD, BOS, EOS, on_gpu=False, seed=3))
    model = build_model(ModelConfig(arch="qwen2", lora=lora), VOCAB, PAD, BOS, EOS, on_gpu=False, seed=3)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    plain_adapted = frozen_copy(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    cfg = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "dsrl": {"batch": {"prompts_per_rollout": world, "samples_per_prompt": 2, "mini_batch_size": 2 * world,
                           "micro_batch_size_per_rank": 1}, "run": {"rollouts": 1},
                 "model": {"lora": lora.model_dump()}},
    }
    rl = dsrl.initialize(model, cfg, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                                                lr=0.5))
    report: dict[str, Any] = {"rank": rank, "stage": stage, "trainable": len(trainable),
                              "trainable_are_adapters": all(".lora_" in n for n in trainable)}

    def micro(i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor([[BOS] + [3 + (7 * rank + 5 * i + j) % (VOCAB - 3) for j in range(5 + i)]])
        return {"input_ids": ids, "targets": torch.roll(ids, -1, 1), "position_ids": torch.arange(ids.shape[1])[None],
                "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}

    micros = [micro(i) for i in range(3 - 2 * rank)]  # uneven: 3 and 1 forwards, fillers pad the short rank

    def fn(m: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return token_logprobs(forward_logits(m, mb), mb["targets"], 1.0).float().cpu()

    policy_before = rl.forward_no_grad(micros, fn)
    reference = AdaptersDisabled(rl).forward_no_grad(micros, fn)
    policy_after = rl.forward_no_grad(micros, fn)
    frozen = frozen_engine(base, rl, rl.device)
    copied, _ = equal_forwards(frozen, micros, fn, micros[0])
    report["reference_vs_frozen_copy"] = max(float((a - b).abs().max()) for a, b in zip(reference, copied))
    report["reference_vs_policy"] = max(float((a - b).abs().max()) for a, b in zip(reference, policy_before))
    report["policy_restored"] = all(torch.equal(a, b) for a, b in zip(policy_before, policy_after))
    report["adapters_trainable_after"] = [n for n, p in rl.module.named_parameters() if p.requires_grad] == trainable

    tok = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    # greedy: not a run-file setting (temperature > 0), but the backends support it
    settings = RolloutConfig.model_construct(**{**RolloutConfig().model_dump(), "max_new_tokens": 6,
                                                "temperature": 0.0, "generation_batch_size": 2})
    prompts = [[BOS, 4 + rank, 9], [BOS, 7, 8, 12 + rank]][: 2 - rank]  # uneven: 2 and 1 prompts

    def greedy(backend: Any) -> list[list[int]]:
        return [c.completion_ids for c in backend.generate(prompts, 2, seed=5)]

    want = greedy(HFRolloutBackend(plain_adapted, tok, settings))
    report["hf_equal"] = greedy(HFRolloutBackend(rl, tok, settings)) == want
    report["cb_equal"] = greedy(ContinuousBatchingBackend(rl, tok, settings)) == want
    report["generated"] = want

    before = full_parameters(rl.engine)
    res = rl.train_mini_batch(micros, lambda m, mb: -token_logprobs(forward_logits(m, mb), mb["targets"], 1.0))
    after = full_parameters(rl.engine)
    report["step_applied"] = bool(res["step_applied"])
    report["base_unchanged"] = all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    report["adapters_moved"] = sum(not torch.equal(before[n], after[n]) for n in trainable)

    module, policy = unwrap(rl)
    with torch.no_grad(), gathered_for_generation(module, policy):
        merged = generation_weights(module)
    names = [n for n, _ in merged]
    plain = build_model(ModelConfig(arch="qwen2"), VOCAB, PAD, BOS, EOS, on_gpu=False, seed=0)
    plain.load_state_dict(dict(merged), strict=True)
    plain.eval()
    got = rl.forward_no_grad(micros, fn)
    report["merged_names_plain"] = sorted(names) == sorted(plain.state_dict().keys())
    report["merged_has_lm_head"] = "lm_head.weight" in names
    with torch.no_grad():
        report["merged_logprob_diff"] = max(float((a - fn(plain, mb)).abs().max()) for a, mb in zip(got, micros))
    report["merged_greedy_equal"] = greedy(HFRolloutBackend(plain, tok, settings)) == greedy(
        HFRolloutBackend(rl, tok, settings))
    return report


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
