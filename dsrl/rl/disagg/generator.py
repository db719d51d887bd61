"""A generator rank of a disaggregated job: its own copy of the policy, a rollout backend, no optimizer state.

:class:`GeneratorWorker` runs the loop

    read the control message (where to start, the prompt stream, k, the replicas' sources, the weights' layout)
    for each rollout r from the start to the plan's last:
        hold the weights of version max(v0, r - k)   (apply the versions trainer 0 sent, in order; idle meanwhile)
        draw rollout r's P prompts (the trainers' stream: the same sampler, seed and position)
        for each replica d this generator serves (D/N contiguous ones):
            generate the replica's P/D prompts x G with seed derived_seed(run seed, r, 0, d): the call the
            colocated replica would make, with the same backend, batches and seed
            send the completions (with their version and behavior log-probs) to the replica's source trainer
    until the stop message

so generation runs at most k versions ahead of training and, for a given start, is a pure function of the
weights, prompts and seeds: a resumed run regenerates what was in flight. The next version's receive is always
posted before generating, so trainer 0's send never waits for a generation. Idle time (waiting for weights)
and generation time travel with the samples into the trainers' metrics.

Failures: a trainer that is gone, or no weights within ``run.collective_timeout_s``, end the generator with a
message naming the trainer side; the launcher stops the job.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from dsrl.config import Config
from dsrl.config.names import VLLM_BACKEND
from dsrl.core.errors import RunError
from dsrl.core.seeds import derived_seed
from dsrl.rl.disagg.roles import Role
from dsrl.rl.disagg.wire import (
    SampleMessage,
    WeightLayout,
    WeightReceiver,
    finished,
    recv_control,
    send_samples,
    wait,
)

log = logging.getLogger("dsrl.rl.disagg.generator")


class GeneratorWorker:
    """One generator rank (module docstring). ``run()`` returns the process exit status."""

    def __init__(self, cfg: Config, role: Role):
        from dsrl.backends.deepspeed.engine import on_gpu
        from dsrl.rl.data.prompts import PromptSampler, PromptSource, load_prompts
        from dsrl.rl.policy.model import build_model, resolve_dtype
        from dsrl.rl.policy.moe import check_moe_run
        from dsrl.rl.policy.tokenizer import load_tokenizer
        from dsrl.rollout import make_backend

        d = self.d = cfg.dsrl
        self.role = role
        gpu = on_gpu()
        check_moe_run(cfg, gpu)  # the trainer ranks refuse the same run file with the same sentence
        self.tokenizer = tok = load_tokenizer(d.model)
        records = load_prompts(d.data, seed=d.run.seed)
        sampler = PromptSampler(len(records), d.batch.prompts_per_rollout, seed=d.run.seed,
                                last_rollout=d.run.last_rollout)
        self.prompts = PromptSource(records, sampler, tok, d.data)
        model = build_model(d.model, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, on_gpu=gpu, seed=d.run.seed)
        if gpu:
            import os

            model = model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
        model.to(resolve_dtype(d.model.dtype, gpu)).eval().requires_grad_(False)
        self.model = model
        kwargs = {}
        if d.rollout.backend == VLLM_BACKEND:
            kwargs = {"max_model_len": d.data.max_prompt_tokens + d.rollout.max_new_tokens,
                      "samples_per_prompt": d.batch.samples_per_prompt, "seed": d.run.seed}
        self.backend = make_backend(d.rollout, model, tok, **kwargs)
        self.bound_s = d.run.collective_timeout_s

    def run(self) -> int:
        try:
            self._loop()
        finally:
            self.backend.close()
        return 0

    def _deadline(self) -> float:
        return time.monotonic() + self.bound_s

    def _trainer_gone(self, what: str, exc: BaseException | None = None) -> RunError:
        why = f" ({str(exc).splitlines()[0][:120]})" if exc else ""
        return RunError(f"{self.role.describe(self.role.global_rank)}: {what}{why}; the trainer side stopped or "
                        "hangs (see its messages)")

    def _loop(self) -> None:
        role, d = self.role, self.d
        try:
            control = recv_control(role.sync, self._deadline())
        except TimeoutError as e:
            raise self._trainer_gone(f"no start message from trainer 0 within {self.bound_s:g} s") from e
        except RuntimeError as e:  # trainer 0 ended before the run started (a configuration error, see its message)
            raise self._trainer_gone("trainer 0 ended before the run started", e) from e
        start, v0, last, k = control["rollout"], control["version"], control["rollouts"], control["max_staleness"]
        self.prompts.sampler.load_state_dict(control["sampler"])
        sources: list[int] = control["sources"]
        layout = WeightLayout.from_json(control["layout"])
        replicas, generators = len(sources), role.generators
        per = replicas // generators
        mine = range(role.role_rank * per, (role.role_rank + 1) * per)
        receiver = WeightReceiver(role.sync, layout)
        receiver.post()
        version: int | None = None
        pending: list[Any] = []
        P, G = d.batch.prompts_per_rollout, d.batch.samples_per_prompt
        for r in range(start, last):
            need = max(v0, r - k)
            t_idle = time.perf_counter()
            while version is None or version < need:
                try:
                    got = receiver.take(self._deadline())
                except RuntimeError as e:
                    raise self._trainer_gone(f"lost trainer 0 while waiting for version {need}", e) from e
                if got is None:
                    raise self._trainer_gone(f"no weights of version {need} within {self.bound_s:g} s")
                version, stop = got
                if stop:
                    self._finish(pending)
                    return
                layout.unpack(receiver.buffers, self.model.state_dict())
                self.backend.sync_weights()
                receiver.post()
            idle = time.perf_counter() - t_idle
            indices = self.prompts.next_indices()
            share = P // replicas
            for i, replica in enumerate(mine):
                t0 = time.perf_counter()
                _, prompt_ids = self.prompts.encode(indices[replica * share:(replica + 1) * share])
                seed = derived_seed(d.run.seed, r, 0, replica)
                completions = self.backend.generate(prompt_ids, G, seed=seed)
                for c in completions:
                    c.version = version
                msg = SampleMessage(r, replica, version, completions, time.perf_counter() - t0, idle if i == 0 else 0.0)
                pending = [(w, t) for w, t in pending if not finished(w)]
                pending += send_samples(role.bridge, sources[replica], msg)
        # the plan's last rollout is generated: wait for the stop message so trainer 0's last send completes
        while True:
            try:
                got = receiver.take(self._deadline())
            except RuntimeError:
                return
            if got is None or got[1]:
                self._finish(pending)
                return
            receiver.post()

    def _finish(self, pending: list[Any]) -> None:
        """Let the sends still in flight complete (trainers that stopped early never receive them)."""
        deadline = time.monotonic() + 5.0
        for work, _ in pending:
            try:
                if not wait(work, deadline):
                    break
            except RuntimeError:
                break
