"""dsrl.check's float32 reference for a real model on ZeRO-3 (:func:`dsrl.cli.check.micro_batch_reference` with
``zero3``): through the identity autograd nodes of :func:`dsrl.cli.check_models.with_zero3_autograd_nodes`, the plain
module's gradient is bit for bit a one-rank ZeRO-3 engine's on a tiny tied Llama. Without them (the plain module, the
planted failure) it is not on this machine: the nodes change the order autograd sums a tensor's gradients in float32,
which on SmolLM2-135M alone was 1e-6, the old ZeRO-3 residue."""

from __future__ import annotations

import json

from conftest import free_port, one_rank


def test_the_zero3_reference_is_the_engines_gradient_bit_for_bit():
    proc = one_rank(["tests/workers/zero3_reference_worker.py", str(free_port())], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["mirrored"] and found["same_loss"], found
