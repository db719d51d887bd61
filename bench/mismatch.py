"""The behavior policy's mismatch: each rollout backend's log-probs of the tokens it sampled (mu) against the
trainer's recompute of the same tokens (pi_old, the full forward the trainer runs), per backend and dtype.

    python bench/mismatch.py                 # hf, cb and vllm (when it imports) x float32, bfloat16 on the CPU
    python bench/mismatch.py --device cuda   # on a GPU (not run yet)

Workload: a Qwen2 of the ``scaled`` shape (26.5 M parameters, head size 64 so vLLM's CPU kernels serve it)
with random weights and an output head scaled to a logit std of ``--logit_std`` (a random init gives near
uniform distributions, where every kernel agrees), P = 32 prompts x G = 4 samples x up to 64 tokens at
temperature 1. mu comes from each backend's own ``behavior_logprobs``; pi_old from dsrl's trainer path
(``dsrl.rl.data.batching.collate`` + ``dsrl.rl.policy.logprobs.forward_logprobs``, the fused head) on the same model
in the same dtype. Reported over all completion tokens: mean and max |log pi_old - log mu|, the mean k3
estimate of KL(mu || pi_old), the largest w = pi_old / mu, and the fraction of tokens whose w leaves
[1/2, 2] (what ``rollout_correction.mode = "mis"`` with cap 2 would drop). Nothing asserts on these values.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import types

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import BOS, EOS, PAD, SHAPES, report, table  # noqa: E402

from dsrl.config import ModelConfig, RolloutConfig  # noqa: E402
from dsrl.rl.data.batching import Sample, collate, completion_positions  # noqa: E402
from dsrl.rl.policy.logprobs import forward_logprobs  # noqa: E402
from dsrl.rl.policy.model import build_model  # noqa: E402


def policy(dtype: str, device: str, logit_std: float) -> torch.nn.Module:
    spec = SHAPES["scaled"]
    model = build_model(ModelConfig(arch="qwen2", dtype=dtype, tiny={**spec["tiny"], "tie_word_embeddings": False}),
                        spec["vocab"], PAD, BOS, EOS, on_gpu=device != "cpu", seed=0).to(device).eval()
    with torch.no_grad():
        ids = torch.tensor([[BOS, 5, 6, 7, 8]], device=device)
        std = model(input_ids=ids).logits.float().std()
        model.lm_head.weight.mul_(logit_std / std)
    return model


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[BOS] + torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(4, 24, (n,),
                                                                                                      generator=g)]


def trainer_logprobs(model: torch.nn.Module, completions: list, device: str) -> list[list[float]]:
    samples = [Sample(tokens=c.prompt_ids + c.completion_ids, prompt_len=len(c.prompt_ids), group=0, reward=0.0)
               for c in completions]
    out = []
    with torch.no_grad():
        for start in range(0, len(samples), 16):
            chunk = samples[start:start + 16]
            micro = collate(chunk, PAD, device, with_logprobs=False)
            lp = forward_logprobs(model, micro).logprobs.cpu()  # the trainer's own pass (fused head)
            out += [row[sl].tolist() for row, sl in zip(lp, completion_positions(chunk))]
    return out


def backends(model: torch.nn.Module, cfg: RolloutConfig, names: list[str], max_len: int, g: int) -> dict:
    tok = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    out = {}
    if "hf" in names:
        from dsrl.rollout.hf import HFRolloutBackend

        out["hf"] = HFRolloutBackend(model, tok, cfg)
    if "cb" in names:
        from dsrl.rollout.cb import ContinuousBatchingBackend

        out["cb"] = ContinuousBatchingBackend(model, tok, cfg)
    if "vllm" in names:
        from dsrl.rollout.vllm import VLLMRolloutBackend

        out["vllm"] = VLLMRolloutBackend(model, tok, cfg, max_model_len=max_len, samples_per_prompt=g)
        out["vllm"].sync_weights()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["hf", "cb", "vllm"], choices=["hf", "cb", "vllm"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples_per_prompt", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--logit_std", type=float, default=2.0)
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    names = [n for n in args.backends if n != "vllm" or importlib.util.find_spec("vllm") is not None]
    skipped = sorted(set(args.backends) - set(names))
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, generation_batch_size=args.prompts)
    ps = prompts(args.prompts, SHAPES["scaled"]["vocab"])
    rows = []
    for dtype in args.dtypes:
        model = policy(dtype, args.device, args.logit_std)
        for name, backend in backends(model, cfg, names, 24 + args.max_new_tokens, args.samples_per_prompt).items():
            cs = backend.generate(ps, args.samples_per_prompt, seed=1)
            pi = trainer_logprobs(model, cs, args.device)
            diffs = [p - m for c, row in zip(cs, pi) for p, m in zip(row, c.behavior_logprobs)]
            n = len(diffs)
            absd = [abs(d) for d in diffs]
            kl = sum(math.exp(d) - 1 - d for d in diffs) / n
            outside = sum(abs(d) > math.log(2) for d in diffs) / n
            rows.append([name, dtype, n, f"{sum(absd) / n:.2e}", f"{max(absd):.2e}", f"{kl:.2e}",
                         f"{math.exp(max(diffs)):.4f}", f"{outside:.2%}"])
            print(" | ".join(str(x) for x in rows[-1]), flush=True)
            backend.close()
    body = (f"{args.device}; Qwen2 'scaled' shape, random weights, output logits scaled to std {args.logit_std:g}; "
            f"{args.prompts} prompts x G = {args.samples_per_prompt}, up to {args.max_new_tokens} tokens, "
            "temperature 1; mu = the backend's behavior log-probs, pi_old = dsrl's trainer forward on the same model "
            "and dtype. w = pi_old / mu per completion token."
            + (f" Not measured (not importable here): {', '.join(skipped)}." if skipped else "") + "\n\n")
    body += table(["backend", "dtype", "tokens", "mean |dlogp|", "max |dlogp|", "KL(mu||pi_old)", "max w",
                   "w outside [1/2, 2]"], rows)
    report("Behavior-policy mismatch: rollout backends vs the trainer (bench/mismatch.py)", body, args.no_record)


if __name__ == "__main__":
    main()
