"""Checkpoints: atomic commits and their manifest, the run directory and its lock, elastic resume, export.

Owns: the atomic commit of an engine's files (:mod:`.commit`, :mod:`.manifest`, :mod:`.atomic_io`),
saving and resuming RLEngines with their companions (:mod:`.engines`), resume on another world size
through universal checkpoints (:mod:`.elastic`), the output directory and its lock (:mod:`.run_dir`,
:mod:`.output_lock`) and the Hugging Face export (:mod:`.export`).

May import: :mod:`dsrl.backends.deepspeed`, :mod:`dsrl.backends.megatron`, :mod:`dsrl.core`, :mod:`dsrl.config`;
never :mod:`dsrl.rl`.
"""
