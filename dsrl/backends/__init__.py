"""The training frameworks dsrl drives: :mod:`.deepspeed` (RLEngine, ``dsrl.initialize``) and
:mod:`.megatron` (the RL step inside a Megatron loop). Neither imports the other."""
