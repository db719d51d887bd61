"""One process (``python zero3_reference_worker.py PORT``): a tiny tied Llama's gradient on one micro-batch from a
ZeRO-3 engine, from the plain module, and from the plain module through
:func:`dsrl.cli.check_models.with_zero3_autograd_nodes`; prints one JSON line saying which equal the engine's bit for
bit, and whether the nodes left the loss bit for bit the plain module's (tests/distributed/test_zero3_reference.py)."""

from __future__ import annotations

import copy
import json
import os
import sys

import deepspeed
import torch
from deepspeed.utils import safe_get_full_grad
from transformers import LlamaConfig, LlamaForCausalLM

from dsrl.cli.check_models import with_zero3_autograd_nodes
from dsrl.runtime.process_exit import leave


def main() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    plain = LlamaForCausalLM(cfg)
    mirrored = with_zero3_autograd_nodes(copy.deepcopy(plain))
    model = copy.deepcopy(plain)
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_allow_untested_optimizer": True})
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(1))

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        logits = m(input_ids=ids).logits.float()
        return -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()

    plain_loss, mirrored_loss = loss_of(plain), loss_of(mirrored)
    plain_loss.backward()
    mirrored_loss.backward()
    engine.backward(loss_of(engine))
    zero3 = [safe_get_full_grad(p) for p in engine.module.parameters()]
    print(json.dumps({
        "plain": all(torch.equal(p.grad, g) for p, g in zip(plain.parameters(), zero3)),
        "mirrored": all(torch.equal(p.grad, g) for p, g in zip(mirrored.parameters(), zero3)),
        "same_loss": torch.equal(plain_loss, mirrored_loss),
    }))


if __name__ == "__main__":
    main()
    leave(0)  # no interpreter finalization while gloo's threads live (dsrl.runtime.process_exit)
