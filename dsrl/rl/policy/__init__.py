"""The policy model: building it (a local Hugging Face checkpoint or the tiny built-in model), its LoRA adapters
(:mod:`.lora`: PEFT, adapters as the only trainable parameters), its tokenizer (:mod:`.tokenizer`), and the one
build of the rollout side that colocated, trainer and generator ranks all use (:mod:`.rollout_side`: tokenizer,
model, backend and its arguments).

May import: config, core, backends.deepspeed, rollout; no other room of :mod:`dsrl.rl`.
"""
