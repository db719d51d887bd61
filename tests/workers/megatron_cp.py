"""Context-parallel exactness on CPU: a CP=2 gloo layout with a per-token model.

megatron-core's attention refuses CP > 1 without Transformer Engine (GPU only), so the sequences
are cut across a CP-shaped group with a model whose per-token loss needs no cross-token attention:
each CP rank's loss on its shard is then exactly its share of the whole-sequence loss, and the
Megatron DDP / schedule / finalize path is the real one (the DP x CP reduction included). The
seq-mean-* weights need the *whole* sequence's n_s: dsrl carries it as ``seq_valid_tokens``; the
naive shard-local n_s is shown to be wrong on the same data.
"""

from __future__ import annotations

import copy
from typing import Any

import megatron_common as mc
import torch
import torch.distributed as dist

from dsrl.backends.megatron import MegatronRLStep, shard_for_context_parallel
from dsrl.config.names import LOSS_AGG_MODES, SEQ_MEAN_TOKEN_MEAN

VOCAB_CP, HID_CP = 32, 16


def _token_model_cls() -> type:
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class TokenModel(MegatronModule):
        """Per-token LM: CE of labels given (token, absolute position); no mixing across positions."""

        def __init__(self, config: Any):
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.emb = torch.nn.Embedding(VOCAB_CP, HID_CP)
            self.pos = torch.nn.Embedding(mc.MAX_POS, HID_CP)
            self.fc = torch.nn.Linear(HID_CP, HID_CP)
            self.out = torch.nn.Linear(HID_CP, VOCAB_CP)

        def set_input_tensor(self, input_tensor: Any) -> None:  # no pipeline stages here
            pass

        def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.fc(self.emb(tokens) + self.pos(position_ids)))
            logp = torch.log_softmax(self.out(h).to(self.fc.weight.dtype), dim=-1)
            return -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    return TokenModel


def token_forward(model: Any, mb: dict) -> torch.Tensor:
    return model(mb["tokens"], mb["position_ids"], mb["labels"])


def _build(per_token: bool) -> tuple[Any, Any, Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from dsrl.backends.megatron import build_param_scheduler

    torch.manual_seed(0)
    cfg = mc.transformer_config(per_token)
    module = _token_model_cls()(cfg)
    ref = copy.deepcopy(module).double()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), module)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0, min_lr=0.0, clip_grad=0.0), [ddp])
    sched = build_param_scheduler(opt, total_optimizer_steps=10, max_lr=0.0)
    return ddp, opt, sched, ref


def _grads(ddp: Any) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().double().clone() for n, p in ddp.module.named_parameters()}


def run_cp_suite(checks: dict[str, Any]) -> list[dict[str, Any]]:
    """CP=2 (DP=1): both conventions x all modes, dsrl-sharded and hand-sharded; returns rank 0's cases."""
    from megatron.core import parallel_state as ps

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    assert cp == 2
    gen = torch.Generator().manual_seed(9)
    whole = [mc.make_micro(gen, b=3, vocab=VOCAB_CP, empty_row=(i == 0)) for i in range(3)]
    bsz = sum(mb["loss_mask"].shape[0] for mb in whole)
    by_hand = [shard_for_context_parallel(mb, cp, cp_rank) for mb in whole]
    naive = []
    for mb in by_hand:  # what a shard-local count would give: n_s of this CP shard only
        mb = dict(mb)
        mb["seq_valid_tokens"] = (mb["loss_mask"] != 0).sum(-1)
        naive.append(mb)
    cases: list[dict[str, Any]] = []

    def record(conv: str, mode: str, variant: str, got: dict, ref_model: Any, expect: str = "exact") -> None:
        if dist.get_rank() != 0:
            return
        ref = mc.reference_grads(ref_model, whole, mode, token_forward, mc.ppo_loss, bsz)
        cases.append({"layout": f"cp2/{variant}", "convention": conv, "mode": mode, "expect": expect,
                      "error": mc.relative_error(got, ref), "ratio": mc.ratio_to_reference(got, ref), "result": {}})

    for conv in ("per_token", "average"):
        ddp, opt, sched, ref_model = _build(conv == "per_token")
        step = MegatronRLStep(ddp, opt, sched, convention=conv, mini_batch_size=bsz,
                              loss_agg_norm_length=mc.NORM_LENGTH)
        counts = step.global_counts(by_hand)
        checks[f"cp2/{conv}/counts"] = [counts.tokens, counts.sequences, counts.max_micro_batches, counts.samples]
        for mode in LOSS_AGG_MODES:
            step.loss_agg = mode
            step.cp_shard = True
            step.train_step(whole, token_forward, mc.ppo_loss)
            record(conv, mode, "dsrl_shard", _grads(ddp), ref_model)
            step.cp_shard = False
            step.train_step(by_hand, token_forward, mc.ppo_loss)
            record(conv, mode, "hand_shard", _grads(ddp), ref_model)
        step.loss_agg = SEQ_MEAN_TOKEN_MEAN
        step.train_step(naive, token_forward, mc.ppo_loss)
        record(conv, SEQ_MEAN_TOKEN_MEAN, "shard_local_n_s", _grads(ddp), ref_model, expect="wrong:shard_local_n_s")
    if dist.get_rank() == 0:
        whole_counts = mc.global_counts_of(whole)
        checks["cp2/whole_counts"] = [whole_counts.tokens, whole_counts.sequences]
    return cases
