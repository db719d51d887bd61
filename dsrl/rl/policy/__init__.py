"""The policy model: building it (a local Hugging Face checkpoint or the tiny built-in model), its LoRA adapters
(:mod:`.lora`: PEFT, adapters as the only trainable parameters) and its tokenizer (:mod:`.tokenizer`).

May import: config, core, backends.deepspeed, rollout; no other room of :mod:`dsrl.rl`.
"""
