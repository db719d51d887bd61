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

and, whenever a version arrives flagged for evaluation (``dsrl.eval``: trainer 0 publishes the weights of an
evaluation point, :class:`dsrl.rl.disagg.remote.RemoteEvaluation`), evaluates it before generating on: each
replica's evaluation calls (:func:`dsrl.rl.data.evalset.replica_calls`, the colocated replica's prompts, sampling
and seeds, :func:`dsrl.core.seeds.eval_seed`) with the run's backend under the evaluation's sampling, the
completions sent to the replica's source trainer under the evaluation's tags (:data:`dsrl.rl.disagg.wire.EVAL_TAGS`).

so generation runs at most k versions ahead of training and, for a given start, is a pure function of the
weights, prompts and seeds: a resumed run regenerates what was in flight. The next version's receive is always
posted before generating, so trainer 0's send never waits for a generation. Idle time (waiting for weights)
and generation time travel with the samples into the trainers' metrics.

The generator is built by the same :class:`dsrl.rl.policy.rollout_side.RolloutSide` as the trainers (LoRA structure
and parameter flags included), and the trainers' published ``state_dict`` lands in the same module the local
backends generate with; a ``vllm`` backend takes the merged weights from it at each sync.

Start and failures: the generator's checks (vLLM's refusals among them) are agreed with the trainers' before any
work, so a configuration error of either side is printed once, by rank 0; trainer 0 ending before the start
message sends an abort instead (the generator then ends with its status, silently). A trainer that is gone, or no
weights within ``run.collective_timeout_s``, end the generator with a message naming the trainer side (and any
rank of its host that has ended); the launcher stops the job. Rollouts are numbered as the console numbers them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsrl.config import Config, ConfigError, DsrlConfig, EvalConfig, RolloutConfig
from dsrl.core.errors import RunError
from dsrl.core.seeds import eval_seed, generation_seed
from dsrl.rl.data.evalset import EvalPrompts, prompts_per_call, replica_calls
from dsrl.rl.data.prompts import PromptSource, encode, replica_share
from dsrl.rl.disagg.roles import Role
from dsrl.rl.disagg.wire import (
    EVAL_TAGS,
    SampleMessage,
    WeightLayout,
    WeightReceiver,
    describe_failure,
    finished,
    recv_control,
    send_samples,
    wait,
)
from dsrl.rl.policy.rollout_side import RolloutSide, RolloutSideSettings
from dsrl.rollout.base import RolloutBackend

log = logging.getLogger("dsrl.rl.disagg.generator")


@dataclass(frozen=True)
class GeneratorSettings:
    """What of the run file a generator rank reads: P and G (``batch``), the run's seed, the bound on every wait
    (``run.collective_timeout_s``), and for evaluations the ``eval`` section and its sampling
    (``DsrlConfig.eval_sampling``)."""

    prompts_per_rollout: int
    samples_per_prompt: int
    seed: int
    collective_timeout_s: float
    eval: EvalConfig
    eval_sampling: RolloutConfig

    @classmethod
    def of(cls, d: DsrlConfig) -> GeneratorSettings:
        return cls(d.batch.prompts_per_rollout, d.batch.samples_per_prompt, d.run.seed, d.run.collective_timeout_s,
                   d.eval, d.eval_sampling)


class GeneratorWorker:
    """One generator rank (module docstring), built by :meth:`start`. ``run()`` returns the process exit status."""

    def __init__(self, settings: GeneratorSettings, role: Role, side: RolloutSide, prompts: PromptSource,
                 backend: RolloutBackend, eval_prompts: EvalPrompts | None = None):
        """``side``: this rank's rollout side, its model on the generator's device; ``backend`` generates with it
        (each call one trainer replica's P/D prompts); ``eval_prompts``: the evaluation's (``eval.every`` > 0)."""
        self.settings, self.role, self.side, self.prompts, self.backend = settings, role, side, prompts, backend
        self.eval_prompts = eval_prompts
        self.bound_s = settings.collective_timeout_s
        self.weights = side.weights()  # where the trainers' published state_dict lands, name for name
        self.status = 0

    @classmethod
    def start(cls, cfg: Config, role: Role, *, on_gpu: bool, trainer_replicas: Callable[[], int]) -> GeneratorWorker:
        """The checks first, agreed with the trainers' (:meth:`dsrl.rl.disagg.roles.Role.agree`): a configuration
        error of either side is printed once, by rank 0, and every rank stops before any work. Then the model on
        this rank's device and the backend, built by the same :class:`dsrl.rl.policy.rollout_side.RolloutSide` and
        prompt stream as the trainers'. ``on_gpu``: the accelerator is a GPU; ``trainer_replicas()``: the trainers'
        data-parallel replicas (asked after the agreement: the trainers' engine reads them from the run file,
        :func:`dsrl.rl.run.engines.start_generator`)."""
        d = cfg.dsrl
        problem: ConfigError | RunError | None = None
        side: RolloutSide | None = None
        prompts: PromptSource | None = None
        eval_prompts: EvalPrompts | None = None
        try:
            side = RolloutSide(RolloutSideSettings.of(d), on_gpu)
            prompts = PromptSource.load(d.data, d.batch.prompts_per_rollout, d.run.seed, d.run.last_rollout,
                                        side.tokenizer)
            if d.eval.every:  # the trainers load the same prompts (dsrl.rl.run.parts)
                from dsrl.rl.data.evalset import load_eval_prompts

                eval_prompts = load_eval_prompts(d.eval, d.data, d.run.seed, side.tokenizer,
                                                 train_records=prompts.records,
                                                 asked_by=f"dsrl.eval.every = {d.eval.every}")
            side.build_model()
            side.check()  # this rank builds the backend: vLLM's refusals are found here, before any work
            side.check_moe()  # the trainers refuse the same run file with the same sentence
        except (ConfigError, RunError) as e:
            problem = e
        role.agree(problem)
        assert side is not None and prompts is not None  # agree() raised every rank's problem
        model = side.on_generator_device()
        try:
            # each call generates one trainer replica's share of a rollout, as the colocated replica's call would
            replicas = trainer_replicas()
            backend = side.backend(model, d.batch.prompts_per_rollout // replicas)
        except Exception as e:  # noqa: BLE001 - any failure to build it is reported as one sentence
            raise RunError(f"{role.describe(role.global_rank)}: could not build the rollout backend "
                           f"{d.rollout.backend!r}: {type(e).__name__}: {describe_failure(e)}") from e
        return cls(GeneratorSettings.of(d), role, side, prompts, backend, eval_prompts)

    def run(self) -> int:
        try:
            self._loop()
        finally:
            self.backend.close()
        return self.status

    def _deadline(self) -> float:
        return time.monotonic() + self.bound_s

    def _trainer_gone(self, what: str, exc: BaseException | None = None) -> RunError:
        why = f" ({describe_failure(exc)})" if exc is not None else ""
        gone = self.role.obituary()
        return RunError(f"{self.role.describe(self.role.global_rank)}: {what}{why}"
                        + (f"; {gone}" if gone else "") + "; the trainer side stopped or hangs (see its messages)")

    def _loop(self) -> None:
        role, st = self.role, self.settings
        try:
            control = recv_control(role.sync, self._deadline())
        except TimeoutError as e:
            raise self._trainer_gone(f"no start message from trainer 0 within {self.bound_s:g} s") from e
        except RuntimeError as e:  # trainer 0 ended before the run started without saying so (see its message)
            raise self._trainer_gone(f"{role.describe(0)} ended before the run started", e) from e
        if "abort" in control:  # trainer 0 stopped before the start and printed why
            self.status = int(control["abort"])
            return
        start, v0, last, k = control["rollout"], control["version"], control["rollouts"], control["max_staleness"]
        self.prompts.sampler.load_state_dict(control["sampler"])
        sources: list[int] = control["sources"]
        layout = WeightLayout.from_json(control["layout"])
        replicas, generators = len(sources), role.generators
        per = replicas // generators
        mine = list(range(role.role_rank * per, (role.role_rank + 1) * per))
        receiver = WeightReceiver(role.sync, layout)
        receiver.post()
        version: int | None = None
        pending: list[Any] = []
        P, G = st.prompts_per_rollout, st.samples_per_prompt
        for r in range(start, last):
            need = max(v0, r - k)
            t_idle = time.perf_counter()
            while version is None or version < need:
                try:
                    got = receiver.take(self._deadline())
                except RuntimeError as e:
                    raise self._trainer_gone(f"lost {role.describe(0)} while waiting for the weights of rollout "
                                             f"{r + 1} (version {need})", e) from e
                if got is None:
                    raise self._trainer_gone(f"no weights for rollout {r + 1} (version {need}) within "
                                             f"{self.bound_s:g} s")
                version = got.version
                if got.stop:
                    self._finish(pending)
                    return
                try:
                    complete = receiver.receive_into(self.weights.state_dict(), self._deadline())
                except RuntimeError as e:
                    raise self._trainer_gone(f"lost {role.describe(0)} while receiving the weights of rollout "
                                             f"{r + 1} (version {version})", e) from e
                if not complete:
                    raise self._trainer_gone(f"the weights of rollout {r + 1} (version {version}) did not arrive "
                                             f"within {self.bound_s:g} s")
                self.backend.sync_weights()
                receiver.post()
                if got.evaluate:
                    pending += self._evaluate(version, sources, mine)
            idle = time.perf_counter() - t_idle
            indices = self.prompts.next_indices()
            for i, replica in enumerate(mine):
                t0 = time.perf_counter()
                _, prompt_ids = self.prompts.encode(replica_share(indices, replica, P // replicas))
                seed = generation_seed(st.seed, r, 0, replica)
                completions = self.backend.generate(prompt_ids, G, seed=seed)
                for c in completions:
                    c.version = version
                msg = SampleMessage(r, replica, version, completions, time.perf_counter() - t0, idle if i == 0 else 0.0)
                pending = [(w, t) for w, t in pending if not finished(w)]
                pending += send_samples(role.bridge, sources[replica], msg)
        # the plan's last rollout is generated: wait for the stop message so trainer 0's last send completes, and
        # evaluate the weights after the last rollout when trainer 0 asks
        while True:
            try:
                got = receiver.take(self._deadline())
                if got is not None and not got.stop:  # a version sent after the last rollout: take its buckets
                    # (into the model only when it is to be evaluated)
                    receiver.receive_into(self.weights.state_dict() if got.evaluate else None, self._deadline())
            except RuntimeError:
                return
            if got is None or got.stop:
                self._finish(pending)
                return
            if got.evaluate:
                self.backend.sync_weights()
            receiver.post()
            if got.evaluate:
                pending = [(w, t) for w, t in pending if not finished(w)]
                pending += self._evaluate(got.version, sources, mine)

    def _evaluate(self, version: int, sources: list[int], mine: list[int]) -> list[Any]:
        """Evaluate the weights of ``version`` for the replicas in ``mine`` (module docstring); returns the posted
        sends."""
        st, prompts = self.settings, self.eval_prompts
        if prompts is None:
            raise RunError(f"{self.role.describe(self.role.global_rank)}: trainer 0 asked for an evaluation but "
                           "dsrl.eval.every is 0 on this rank (every rank must read the same run file)")
        replicas = len(sources)
        per_call = prompts_per_call(st.prompts_per_rollout // replicas, st.samples_per_prompt,
                                    st.eval.samples_per_prompt)
        calls = {d: replica_calls(len(prompts), replicas, d, per_call) for d in mine}
        data, tok = self.prompts.data_cfg, self.prompts.tokenizer
        backend, pending = self.backend.with_sampling(st.eval_sampling), []
        try:
            backend.sync_weights()
            for c in range(len(calls[mine[0]])):
                for d in mine:
                    t0 = time.perf_counter()
                    records = [prompts.records[i] for i in calls[d][c]]
                    ids = encode(tok, [r["prompt"] for r in records], data.max_prompt_tokens, data.chat_template,
                                 data.system_prompt).ids if records else []
                    completions = backend.generate(ids, st.eval.samples_per_prompt,
                                                   seed=eval_seed(st.seed, version, d, c))
                    for comp in completions:
                        comp.version = version
                    msg = SampleMessage(version, d, version, completions, time.perf_counter() - t0)
                    pending += send_samples(self.role.bridge, sources[d], msg, EVAL_TAGS)
        finally:
            backend.close()
        return pending

    def _finish(self, pending: list[Any]) -> None:
        """Let the sends still in flight complete (trainers that stopped early never receive them)."""
        deadline = time.monotonic() + 5.0
        for work, _ in pending:
            try:
                if not wait(work, deadline):
                    break
            except RuntimeError:
                break
