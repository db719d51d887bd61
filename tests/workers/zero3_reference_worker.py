"""One process: a tiny tied Llama's gradient on one micro-batch from a ZeRO-3 engine, from the plain module, and from
the plain module through :func:`dsrl.cli.check_models.with_zero3_autograd_nodes`; prints one JSON line saying which
equal the engine's bit for bit (tests/distributed/test_zero3_reference.py)."""

from __future__ import annotations

import copy
import json
import os
import socket

import deepspeed
import torch
from deepspeed.utils import safe_get_full_grad
from transformers import LlamaConfig, LlamaForCausalLM

from dsrl.cli.check_models import with_zero3_autograd_nodes
from dsrl.runtime.process_exit import leave


def main() -> None:
    with socket.socket() as s:  # a one-rank process group on a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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

    loss_of(plain).backward()
    loss_of(mirrored).backward()
    engine.backward(loss_of(engine))
    zero3 = [safe_get_full_grad(p) for p in engine.module.parameters()]
    print(json.dumps({
        "plain": all(torch.equal(p.grad, g) for p, g in zip(plain.parameters(), zero3)),
        "mirrored": all(torch.equal(p.grad, g) for p, g in zip(mirrored.parameters(), zero3)),
        "values_unchanged": all(torch.equal(a, b) for a, b in zip(plain.parameters(), mirrored.parameters())),
    }))


if __name__ == "__main__":
    main()
    leave(0)  # no interpreter finalization while gloo's threads live (dsrl.runtime.process_exit)
