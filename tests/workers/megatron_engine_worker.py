"""Worker of tests/distributed/test_megatron_engine.py: the Megatron engine (dsrl.backends.megatron.engine) built from a
Hugging Face model runs the application's forwards and one exact optimizer step, at TP = 2, PP = 2 and DP = 2 on two
CPU ranks (gloo, the test-only CUDA shim).

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/megatron_engine_worker.py --out r.json

For each architecture (Llama, untied head; Qwen2, tied head) and layout, on the same random HF model on every rank:

- ``forward_no_grad`` with dsrl's fused log-probs (``dsrl.rl.policy.logprobs.forward_logprobs``, unchanged) against
  the HF model's own in float32, on every rank (pipeline stages get the last stage's);
- ``train_mini_batch(micros, forward, token_loss)`` over an uneven split (1 + 3 + 4 sequences; at DP = 2 one
  replica holds 1 + 3, the other 4, so it runs a filler) with plain SGD at lr = 2**20, so that the update read back
  in HF names (``gather_hf_weights``) is -lr times the gradient: against the float64 reference gradient of the
  mini-batch loss (``dsrl.cli.check.reference_gradient``), for token-mean and seq-mean-token-mean;
- the step's counters and schedule (one applied step, the schedule at 1), and the TrainEngine protocol;
- at DP = 2 with the default optimizer settings (Adam): two steps apply and the replicas agree bit for bit;
- at TP = 2 and PP = 2, after an Adam step, the weights streamed by HF name into a Hugging Face replica on every rank
  give the engine's log-probs (the behaviour policy's against the trainer's);
- at TP = 2 and PP = 2, the application's PolicyActor on the engine with a KL reference: old and reference log-probs
  against the HF model's, and an on-policy GRPO step;
- at TP = 2, PP = 2 and DP = 2, a run resumed from the engine's dist-checkpointing checkpoint makes bit for bit the
  step the saving run made, and no process the save started is left running (a resume that drops dsrl's schedule
  state differs: the planted case).

``--plant`` declares the output head's vocabulary shard without its tensor group (each rank's shard alone): the
TP = 2 rows must then fail both checks.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch"))
import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.install()

from dsrl.backends.megatron import hf_weights  # noqa: E402
from dsrl.backends.megatron.engine import MegatronLayout, OptimizerSettings, build_engine, initialize_parallel  # noqa: E402
from dsrl.cli.check import LR, MAX_LEN, collate, make_sequences, reference_gradient  # noqa: E402
from dsrl.core.engine import TrainEngine  # noqa: E402
from dsrl.rl.policy.logprobs import forward_logprobs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_common import hf_causal_lm, write_rows  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=50000.0,
             pad_token_id=2)  # a pad id that occurs as an input: its embedding row takes no lookup gradient
N_SEQS = 8


def hf_model(kind: str) -> torch.nn.Module:
    from dsrl.cli.check_objectives import VOCAB

    return hf_causal_lm(kind, 11, vocab_size=VOCAB, **SHAPE)


def hf_state(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF model's weights by name, copied, as a tied model's safetensors hold them (no ``lm_head.weight``)."""
    return {k: v.clone() for k, v in hf.state_dict().items()
            if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}


def plan_of(*, rollouts: int = 1, micro_batch_size: int = 1, **batch: Any) -> tuple[Any, Any]:
    """(run file, plan) of N_SEQS sequences in two prompt groups, one mini-batch per rollout, for this data-parallel
    size; ``batch`` adds ``dsrl.batch`` fields, a ``sections`` dict other sections."""
    from megatron.core import parallel_state as ps

    from dsrl import BatchPlan, load_config

    sections = batch.pop("sections", {})
    cfg = load_config({"dsrl": {"batch": {"prompts_per_rollout": 2, "samples_per_prompt": N_SEQS // 2,
                                          "mini_batch_size": N_SEQS, "micro_batch_size_per_rank": micro_batch_size,
                                          **batch}, "run": {"rollouts": rollouts}, **sections}})
    return cfg, BatchPlan.from_config(cfg, ps.get_data_parallel_world_size())


def micro(seqs: list[dict]) -> dict[str, torch.Tensor]:
    """check.collate's micro-batch with what a causal LM's forward reads (right padding)."""
    out = collate(seqs)
    b, t = out["input_ids"].shape
    lengths = torch.tensor([s["input_ids"].shape[0] for s in seqs])
    out["attention_mask"] = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).long()
    out["position_ids"] = torch.arange(t).expand(b, t).contiguous()
    return out


def logprobs(model, mb: dict) -> torch.Tensor:
    return forward_logprobs(model, mb).logprobs


def advantage_loss(logp: torch.Tensor, mb: dict) -> torch.Tensor:
    return -mb["advantages"].unsqueeze(-1).to(logp.dtype) * logp


def run_case(kind: str, tp: int, pp: int, mode: str, plant: bool) -> dict:
    from megatron.core import parallel_state as ps

    from dsrl.core.logprobs import VocabShard, declare_vocab_shard

    initialize_parallel(MegatronLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    hf = hf_model(kind)
    _, plan = plan_of(loss_agg=mode, loss_agg_norm_length=MAX_LEN)
    engine = build_engine(hf.config, hf_state(hf), plan, MegatronLayout(tp, pp),
                          OptimizerSettings(lr=LR, optimizer="sgd", use_distributed_optimizer=False))
    if plant and engine.module.head is not None:
        head = engine.module.head
        declare_vocab_shard(head, VocabShard(None, ps.get_tensor_model_parallel_rank() * head.weight.shape[0],
                                             head.weight.shape[0]))
    seqs = make_sequences(N_SEQS, seed=3)
    parts = [[seqs[0:1], seqs[1:4]], [seqs[4:8]]] if ps.get_data_parallel_world_size() == 2 \
        else [[seqs[0:1], seqs[1:4], seqs[4:8]]]
    mine = [micro(p) for p in parts[ps.get_data_parallel_rank()]]
    # no-grad pass: the engine's against the HF model's, float32
    got = engine.forward_no_grad(mine, logprobs)
    with torch.no_grad():
        want = [logprobs(hf, mb) for mb in mine]
    logprob_error = max(float((g - w).abs().max()) for g, w in zip(got, want))
    # one exact step: -update / lr against the float64 gradient
    before = {n: t.clone() for n, t in  # gather_hf_weights may return the parameters themselves
              hf_weights.gather_hf_weights(engine.model[0], hf.config, ps.get_tensor_model_parallel_group()).items()}
    res = engine.train_mini_batch(mine, logprobs, advantage_loss)
    after = hf_weights.gather_hf_weights(engine.model[0], hf.config, ps.get_tensor_model_parallel_group())
    grads = {n: (before[n].double() - after[n].double()) / LR for n in after}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, grads if ps.get_data_parallel_rank() == 0 and
                           ps.get_tensor_model_parallel_rank() == 0 else {})
    merged: dict = {}
    for part in everyone:
        merged.update(part)
    ref = reference_gradient(hf, seqs, mode, MAX_LEN)
    ref = {n.replace("_orig_mod.", ""): g for n, g in ref.items() if not (n == "lm_head.weight" and
                                                                           hf.config.tie_word_embeddings)}
    missing = sorted(set(ref) ^ set(merged))
    num = sum(float(((merged[n] - ref[n]) ** 2).sum()) for n in ref if n in merged)
    den = sum(float((ref[n] ** 2).sum()) for n in ref)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, logprob_error)
    return {"arch": kind, "tp": tp, "pp": pp, "dp": ps.get_data_parallel_world_size(), "mode": mode, "plant": plant,
            "logprob_error": max(errors), "grad_error": (num / den) ** 0.5, "missing": missing,
            "optimizer_steps": engine.optimizer_steps, "schedule": engine.state_dict()["schedule"]["scheduler"]
            ["num_steps"], "tokens": int(res["tokens"]), "is_train_engine": isinstance(engine, TrainEngine)}


def run_distributed_adam() -> dict:
    """DP = 2 with the default settings (Adam; megatron-core's distributed optimizer takes CUDA tensors only, so on
    the CPU its plain optimizer): two steps apply, and both replicas hold the same weights after them."""
    from megatron.core import parallel_state as ps


    initialize_parallel(MegatronLayout(), seed=0)
    hf = hf_model("llama")
    _, plan = plan_of(rollouts=2)
    engine = build_engine(hf.config, hf_state(hf), plan, MegatronLayout(), OptimizerSettings(lr=1e-3))
    seqs = make_sequences(N_SEQS, seed=4)
    parts = [[seqs[0:3]], [seqs[3:5], seqs[5:8]]]
    mine = [micro(p) for p in parts[ps.get_data_parallel_rank()]]
    start = {n: t.clone() for n, t in hf_weights.gather_hf_weights(engine.model[0], hf.config).items()}
    results = [engine.train_mini_batch(mine, logprobs, advantage_loss) for _ in range(2)]
    weights = hf_weights.gather_hf_weights(engine.model[0], hf.config)
    replicas: list = [None] * dist.get_world_size()
    dist.all_gather_object(replicas, {n: t.clone() for n, t in weights.items()})
    return {"case": "distributed_adam", "applied": [bool(r["step_applied"]) for r in results],
            "optimizer_class": type(engine.optimizer).__name__,
            "replicas_equal": all(torch.equal(replicas[0][n], replicas[1][n]) for n in weights),
            "changed": sum(not torch.equal(start[n], weights[n]) for n in weights), "weights": len(weights),
            "schedule": engine.state_dict()["schedule"]["scheduler"]["num_steps"]}


def run_weight_sync(tp: int, pp: int) -> dict:
    """After an Adam step, the engine's weights streamed by HF name (``MegatronEngine.hf_weights``) into a Hugging Face
    replica on every rank: the replica's log-probs (the behaviour policy's, as a rollout model computes them) against
    the engine's own no-grad pass, float32."""


    initialize_parallel(MegatronLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    hf = hf_model("qwen2" if pp > 1 else "llama")  # the tied head across stages, the untied one across TP
    _, plan = plan_of()
    engine = build_engine(hf.config, hf_state(hf), plan, MegatronLayout(tp, pp), OptimizerSettings(lr=1e-2))
    seqs = make_sequences(N_SEQS, seed=5)
    mine = [micro(seqs[:3]), micro(seqs[3:])]
    engine.train_mini_batch(mine, logprobs, advantage_loss)
    rollout = hf_model("qwen2" if pp > 1 else "llama")
    own = dict(rollout.named_parameters())
    received = []
    with torch.no_grad():
        for name, tensor in engine.hf_weights():
            own[name].copy_(tensor)
            received.append(name)
    trained = engine.forward_no_grad(mine, logprobs)
    with torch.no_grad():
        behaviour = [logprobs(rollout, mb) for mb in mine]
        untrained = [logprobs(hf, mb) for mb in mine]
    error = max(float((a - b).abs().max()) for a, b in zip(trained, behaviour))
    # what a sync that delivered nothing would leave: the check's power
    step_effect = max(float((a - b).abs().max()) for a, b in zip(trained, untrained))
    moved = max(float((own[n] - p).abs().max()) for n, p in hf.named_parameters())
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, (error, sorted(received) == sorted(own), len(received) == len(set(received)),
                                    step_effect))
    return {"case": "weight_sync", "tp": tp, "pp": pp, "logprob_error": max(e[0] for e in errors),
            "every_weight_once": all(e[1] and e[2] for e in errors), "moved": moved,
            "step_effect": min(e[3] for e in errors)}


def run_resume(tp: int, pp: int, directory: str) -> dict:
    """Resume bit for bit through dist-checkpointing: an engine steps, saves, steps again; a fresh engine loads the
    checkpoint and makes that second step: the same weights (bitwise, by HF name) and the same step result. Planted:
    a third loads the checkpoint but keeps a fresh engine's schedule (the LR moves every step here), and differs."""
    from megatron.core import parallel_state as ps


    initialize_parallel(MegatronLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    hf = hf_model("qwen2" if pp > 1 else "llama")
    _, plan = plan_of(rollouts=3)
    state = hf_state(hf)
    settings = OptimizerSettings(lr=1e-2, warmup_steps=1, decay_style="cosine")
    seqs = make_sequences(N_SEQS, seed=6)
    mine = [micro(seqs[:3]), micro(seqs[3:])] if ps.get_data_parallel_world_size() == 1 else \
        [micro(seqs[:4] if ps.get_data_parallel_rank() == 0 else seqs[4:])]

    def weights(engine) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in engine.hf_weights()}

    first = build_engine(hf.config, state, plan, MegatronLayout(tp, pp), settings)
    first.train_mini_batch(mine, logprobs, advantage_loss)
    first.save_checkpoint(directory)
    leftover = len(multiprocessing.active_children())  # the checkpoint writer's helper process is stopped
    want = first.train_mini_batch(mine, logprobs, advantage_loss).to_dict()
    want_weights = weights(first)
    resumed = build_engine(hf.config, state, plan, MegatronLayout(tp, pp), settings)
    resumed.load_checkpoint(directory)
    got = resumed.train_mini_batch(mine, logprobs, advantage_loss).to_dict()
    got_weights = weights(resumed)
    planted = build_engine(hf.config, state, plan, MegatronLayout(tp, pp), settings)
    fresh_step_state = planted.state_dict()
    planted.load_checkpoint(directory)
    planted.load_state_dict(fresh_step_state)  # the planted bug: the schedule and counters not restored
    planted.train_mini_batch(mine, logprobs, advantage_loss)
    planted_weights = weights(planted)
    mine_row = (leftover == 0 and all(torch.equal(want_weights[n], got_weights[n]) for n in want_weights), want == got,
                any(not torch.equal(want_weights[n], planted_weights[n]) for n in want_weights))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine_row)
    return {"case": "resume", "tp": tp, "pp": pp, "dp": ps.get_data_parallel_world_size(),
            "weights_equal": all(r[0] for r in rows), "results_equal": all(r[1] for r in rows),
            "planted_differs": all(r[2] for r in rows), "optimizer_steps": resumed.optimizer_steps}


def run_actor(tp: int, pp: int) -> dict:
    """The application's policy actor (``dsrl.rl.policy.actor.PolicyActor``, unchanged: it knows only the
    TrainEngine protocol) on the Megatron engine, with a KL reference (a frozen copy the engine places): its old and
    reference log-probs of a rollout's samples against the Hugging Face model's, and one GRPO step with its
    PolicyLoss (on-policy: no token clipped, the KL zero)."""
    import random

    from dsrl import algos
    from dsrl.rl.data.batching import Sample
    from dsrl.rl.data.batching import collate as collate_samples
    from dsrl.rl.policy.actor import ActorSettings, PolicyActor
    from dsrl.runtime.phases import PhaseClock

    initialize_parallel(MegatronLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    hf = hf_model("llama")
    cfg, plan = plan_of(micro_batch_size=4, sections={"algorithm": {"kl_coef": 0.05},
                                                      "rollout": {"logprob_micro_batch_size": 3}})
    d = cfg.dsrl
    layout = MegatronLayout(tp, pp)
    actor = PolicyActor.build(hf_model("llama"), lambda m: build_engine(m.config, m.state_dict(), plan, layout,
                                                                        OptimizerSettings(lr=1e-3)),
                              d.model, ActorSettings.of(d), algos.resolve_algorithm(d.algorithm), moe=False,
                              phases=PhaseClock())
    rng = random.Random(9)
    samples = []
    for i in range(N_SEQS):
        prompt = [rng.randrange(1, 32) for _ in range(rng.randrange(2, 6))]
        completion = [rng.randrange(1, 32) for _ in range(rng.randrange(1, 8))]
        samples.append(Sample(tokens=prompt + completion, prompt_len=len(prompt), group=i // 4, reward=float(i % 2),
                              advantage=1.0 if i % 2 else -1.0))
    batches = actor.pass_batches(samples, pad_id=0)
    actor.add_logprobs(batches, kl_in_reward=False)
    worst = {"old": 0.0, "ref": 0.0}
    with torch.no_grad():
        for s in samples:
            mb = collate_samples([s], pad_id=0)
            want = logprobs(hf, mb)[0, s.prompt_len - 1:len(s.tokens) - 1]
            worst["old"] = max(worst["old"], float((torch.tensor(s.old_logprobs) - want).abs().max()))
            worst["ref"] = max(worst["ref"], float((torch.tensor(s.ref_logprobs) - want).abs().max()))
    micros = [collate_samples(samples[:4], pad_id=0), collate_samples(samples[4:], pad_id=0)]
    res = actor.train_mini_batch(micros)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, worst)
    return {"case": "actor", "tp": tp, "pp": pp, "old_error": max(e["old"] for e in errors),
            "ref_error": max(e["ref"] for e in errors), "applied": bool(res["step_applied"]),
            "loss": float(res["loss"]), "kl": float(res["kl"]),
            "clipped": float(res["clip_low_frac"]) + float(res["clip_high_frac"])}


def run_real(hf_dir: str, tp: int, pp: int, sequence_parallel: bool = False, cp: int = 1) -> dict:
    """A pretrained model (the real-model tier's SmolLM2-135M-Instruct: 30 layers, a tied head) on the engine: its
    log-probs against transformers', and one exact step against the float64 reference gradient (rank 0 computes it)."""
    layout = MegatronLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                            sequence_parallel=sequence_parallel)
    initialize_parallel(layout, seed=0)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()  # under the CPU shim
    _, plan = plan_of(loss_agg="token-mean")
    engine = build_engine(hf.config, hf_state(hf), plan, layout,
                          OptimizerSettings(lr=LR, optimizer="sgd", use_distributed_optimizer=False))
    seqs = make_sequences(N_SEQS, seed=3)
    mine = [micro(seqs[0:3]), micro(seqs[3:8])]
    got = engine.forward_no_grad(mine, logprobs)
    with torch.no_grad():
        want = [logprobs(hf, mb) for mb in mine]
    logprob_error = max(float((g - w).abs().max()) for g, w in zip(got, want))
    before = {n: t.clone() for n, t in engine.hf_weights()}
    engine.train_mini_batch(mine, logprobs, advantage_loss)
    after = dict(engine.hf_weights())
    grad_error = None
    if dist.get_rank() == 0:
        ref = reference_gradient(hf, seqs, "token-mean", MAX_LEN)
        ref = {n: g for n, g in ref.items() if not (n == "lm_head.weight" and hf.config.tie_word_embeddings)}
        grads = {n: (before[n].double() - after[n].double()) / LR for n in ref}
        num = sum(float(((grads[n] - g) ** 2).sum()) for n, g in ref.items())
        grad_error = (num / sum(float((g ** 2).sum()) for g in ref.values())) ** 0.5

    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, logprob_error)
    return {"case": "real", "tp": tp, "pp": pp, "cp": cp, "sequence_parallel": sequence_parallel,
            "layers": hf.config.num_hidden_layers,
            "logprob_error": max(errors), "grad_error": grad_error}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plant", action="store_true")
    ap.add_argument("--suite", choices=("step", "around", "real"), default="step",
                    help="step: the forwards and the exact step; around: DP replicas, weight sync, actor, resume; "
                         "real: a pretrained model from --hf_dir at PP = 2")
    ap.add_argument("--hf_dir", help="a Hugging Face model directory (--suite real)")
    ap.add_argument("--tp_sp", type=int, default=0, help="--suite real: at this TP with sequence parallelism "
                    "instead of PP = 2 (as many ranks)")
    ap.add_argument("--cp", type=int, default=0, help="--suite real: at this CP instead of PP = 2 (as many ranks)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    if args.plant:
        cases = [("llama", 2, 1, "token-mean")]
    elif args.suite == "step":
        cases = [(kind, tp, pp, mode) for kind in ("llama", "qwen2") for tp, pp in ((2, 1), (1, 2), (1, 1))
                 for mode in ("token-mean", "seq-mean-token-mean")]
    else:
        cases = []
    for kind, tp, pp, mode in cases:
        rows.append(run_case(kind, tp, pp, mode, args.plant))
    if args.suite == "real":
        if args.tp_sp:
            rows.append(run_real(args.hf_dir, args.tp_sp, 1, True))
        elif args.cp:
            rows.append(run_real(args.hf_dir, 1, 1, cp=args.cp))
        else:
            rows.append(run_real(args.hf_dir, 1, 2))
    if args.suite == "around" and not args.plant:
        rows.append(run_distributed_adam())
        rows.extend(run_weight_sync(tp, pp) for tp, pp in ((2, 1), (1, 2)))
        rows.extend(run_actor(tp, pp) for tp, pp in ((2, 1), (1, 2)))
        rows.extend(run_resume(tp, pp, os.path.join(os.path.dirname(args.out), f"checkpoint-tp{tp}-pp{pp}"))
                    for tp, pp in ((2, 1), (1, 2), (1, 1)))
    write_rows(rows, args.out)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)
