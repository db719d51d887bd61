"""The policy model: building it (a local Hugging Face checkpoint or the tiny built-in model), its LoRA adapters
(:mod:`.lora`: PEFT, adapters as the only trainable parameters), its tokenizer (:mod:`.tokenizer`), the one
build of the rollout side that colocated, trainer and generator ranks all use (:mod:`.rollout_side`: tokenizer,
model, backend and its arguments), its per-token log-probs from one forward with the output head fused into a
tiled log-softmax (:mod:`.logprobs`, the entry point of every log-prob pass), its mixture-of-experts routing duties
(:mod:`.moe`), its per-token loss (:mod:`.loss`) and the actor (:mod:`.actor`): the engine, the KL reference, the
routing and the loss behind two verbs, adding a rollout's log-probs and training one mini-batch.

May import: config, core (the engine as :class:`dsrl.core.engine.TrainEngine`), rollout, algos, runtime, and the room
:mod:`dsrl.rl.data`; no other room of :mod:`dsrl.rl`.
"""
