"""The policy model: building it (a local Hugging Face checkpoint or the tiny built-in model), its LoRA adapters
(:mod:`.lora`: PEFT, adapters as the only trainable parameters), its tokenizer (:mod:`.tokenizer`), the one
build of the rollout side that colocated, trainer and generator ranks all use (:mod:`.rollout_side`: tokenizer,
model, backend and its arguments), and its per-token log-probs from one forward with the output head fused into a
tiled log-softmax (:mod:`.logprobs`, the entry point of every log-prob pass).

May import: config, core, backends.deepspeed, rollout; no other room of :mod:`dsrl.rl`.
"""
