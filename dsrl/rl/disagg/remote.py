"""The trainer side of disaggregated generation: a rollout backend whose completions come from generator ranks.

:class:`RemoteRolloutBackend` keeps the :mod:`dsrl.rollout.base` contract for the experience maker, which
therefore runs exactly as in a colocated job (the same prompts per replica, the same scoring, log-probs,
correction, advantages and data path):

- ``sync_weights()`` at the start of rollout r publishes the trainer's weights as **version r** (the
  ``state_dict``, gathered once under ZeRO-3: collective among the trainers; trainer 0 sends it in buckets of at
  most ``dsrl.memory.weight_sync_bucket_mib``, :mod:`dsrl.rl.disagg.wire`, timed as ``weight_sync_s`` with its
  bytes and buckets). A send that fails (a generator gone, or not taking the weights within the bound) is
  reported by trainer 0 with the samples' status, so every trainer stops on it, named. The first call of a run,
  or of a resumed run, first sends the control message;
- ``generate(prompts, G, seed)`` returns this replica's completions of rollout r as its generator sent them,
  generated with version max(v0, r - k), v0 the version this invocation started from and k
  ``algorithm.max_staleness``; each completion carries that version. The prompts are checked against the
  trainer's own: the two sides walk the same prompt stream. A sample older than k versions is never
  returned (an error: the protocol guarantees it);
- waiting is bounded: a generator that sent nothing within 0.9 x ``run.collective_timeout_s`` (a hang), or
  whose connection closed (a death), and a stop request while waiting, are agreed on by every trainer (one
  small all-gather) and raised as :class:`GenerationStopped` naming the generator's role, rank and host (and
  whether its process is frozen); the trainer then commits a checkpoint of its side and ends, and a hung generator
  of its host is ended once the trainers have exited (:meth:`dsrl.runtime.peers.Peers.end_after_exit`);
- ``close()`` sends the stop message; generators exit when they read it;
- rollouts are numbered in messages as the console numbers them (the first is rollout 1);
- evaluation (``dsrl.eval``, :meth:`RemoteRolloutBackend.with_sampling`): the generators evaluate the trainer's
  current weights. The evaluation's ``sync_weights`` publishes them as the next version, flagged for evaluation
  (the next rollout's ``sync_weights`` then has nothing to publish); each generator generates its replicas'
  evaluation calls with that version, the evaluation's sampling and the seeds a colocated replica would use, and
  sends them to the replicas' source trainers under the evaluation's tags, who score and reduce them. Waiting is
  bounded and interrupted exactly as for a rollout's samples.

With k = 0, every rollout is generated from the weights the trainer holds when it starts that rollout, by the
same backend, seeds and generation batches as the colocated replica would use, so training is bitwise the
colocated run with as many ranks as there are trainers.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist

from dsrl.config import MemoryConfig, RolloutConfig, RunConfig
from dsrl.core.buckets import bucket_bytes
from dsrl.core.engine import TrainEngine
from dsrl.core.errors import RunError
from dsrl.core.plan import BatchPlan
from dsrl.rl.data.prompts import PromptSource
from dsrl.rl.data.replica import is_source
from dsrl.rl.disagg.roles import Role
from dsrl.rl.disagg.wire import (
    EVAL_TAGS,
    SampleMessage,
    SampleReceiver,
    WeightLayout,
    WeightSender,
    describe_failure,
    send_control,
)
from dsrl.rollout.base import Completion, RolloutBackend
from dsrl.rollout.policy import gathered_for_generation, unwrap
from dsrl.runtime.peers import FROZEN
from dsrl.runtime.stop import StopControl


class GenerationStopped(RunError):
    """Generation cannot continue: a generator is lost, or a stop was requested while waiting for samples.
    ``hung``: the global ranks of generators that sent nothing within the bound (alive, not answering)."""

    def __init__(self, message: str, requested: bool, hung: list[int] | None = None):
        super().__init__(message, agreed=True)
        self.requested = requested
        self.hung = hung or []


def replica_owner(replica: int, replicas: int, generators: int) -> int:
    """The generator (0-based) that generates a replica's prompts: contiguous blocks of D/N replicas."""
    return replica // (replicas // generators)


class RemoteRolloutBackend(RolloutBackend):
    """Completions from generator ranks (module docstring). Built on every trainer rank (collective)."""

    def __init__(self, role: Role, policy: TrainEngine, rollout: RolloutConfig, run: RunConfig, memory: MemoryConfig,
                 plan: BatchPlan, prompts: PromptSource, stop: StopControl | None = None):
        """``rollout``/``run``/``memory``: the run file's sections (the generators' backend, the collective bound,
        the weight-sync buckets)."""
        self.role, self.policy, self.plan, self.prompts, self.stop = role, policy, plan, prompts, stop
        self.backend_name, self.collective_timeout_s = rollout.backend, run.collective_timeout_s
        self.module, _ = unwrap(policy)
        view = policy.view
        self.replica = view.data_parallel_rank
        self.is_source = is_source(view)
        pairs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, (self.replica, self.is_source, role.global_rank))
        self.sources = [rank for _, rank in sorted((r, g) for r, s, g in pairs if s)]  # replica -> its source
        self.owner = role.generator_global_rank(replica_owner(self.replica, plan.data_parallel_size, role.generators))
        self.receiver = SampleReceiver(role.bridge, self.owner) if self.is_source else None
        self.eval_receiver = SampleReceiver(role.bridge, self.owner, EVAL_TAGS) if self.is_source else None
        # The layout is read from the full weights (under ZeRO-3 the module's own tensors are empty shards outside
        # the gather): one gather, collective among the trainers, like every publish.
        with torch.no_grad(), gathered_for_generation(self.module, self.policy):
            self.layout = (WeightLayout.of(self.module.state_dict(), bucket_bytes(memory.weight_sync_bucket_mib))
                           if role.global_rank == 0 else None)
        self.sender = WeightSender(role.sync, self.layout) if role.global_rank == 0 else None
        self.start_version: int | None = None
        self.version: int | None = None  # the version published last (= the rollout being made)
        self.ahead = False  # an evaluation published the next rollout's version already
        self.timing: dict[str, float] = {}
        self.lost = False  # a generator is gone or hangs: close() does not wait for it
        self.sync_problem: tuple[str, int | None] | None = None  # trainer 0's send failed: (why, hung generator)

    def returns_routes(self) -> bool:
        """Whether the generators' backend (the run's ``rollout.backend`` on the same policy) records routes."""
        from dsrl.rl.policy.moe import routes_unsupported
        from dsrl.rollout.routes import MoERouting

        on_gpu = next(self.module.parameters()).device.type != "cpu"
        return MoERouting.of(self.module) is not None and routes_unsupported(self.backend_name, on_gpu) is None

    @property
    def bound_s(self) -> float:
        return 0.9 * self.collective_timeout_s

    def begin(self, rollout_index: int) -> None:
        """Trainer 0 tells the generators where this invocation starts; every trainer learns whether they took it
        (one small all-gather among the trainers), so a generator that ended before the start (its own error, see
        its message) stops every trainer at once, named."""
        self.start_version = rollout_index
        status = "ok"
        if self.sender is not None:
            try:
                send_control(self.role.sync, {
                    "rollout": rollout_index, "version": rollout_index, "rollouts": self.plan.rollouts,
                    "max_staleness": self.plan.max_staleness, "sampler": self.prompts.sampler.state_dict(),
                    "sources": self.sources, "layout": self.layout.to_json(),
                }, deadline=time.monotonic() + self.bound_s)
                self.role.started = True
            except (RuntimeError, TimeoutError) as e:
                gone = self.role.obituary()
                status = (f"{gone}; the generators did not take the start message" if gone else
                          f"the generator ranks did not take the start message ({describe_failure(e)}): a generator "
                          "ended before the run started or does not answer (see its message)")
        statuses: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(statuses, status)
        problem = next((s for s in statuses if s != "ok"), None)
        if problem is not None:
            self.lost = True
            raise GenerationStopped(f"{problem}; the trainer side stops before rollout {rollout_index + 1}",
                                    requested=False)

    def sync_weights(self) -> None:
        """Publish the weights as the next version (collective among the trainers under ZeRO-3), unless an
        evaluation published them already."""
        if self.ahead:
            self.ahead = False
            return
        self.publish(evaluate=False)

    def publish(self, evaluate: bool) -> int:
        """Publish the weights as the next version (``evaluate``: the generators evaluate it); returns it. A send
        that fails is reported with the next receive's status (every trainer stops on it, named)."""
        version = self.start_version if self.version is None else self.version + 1
        if version is None:
            raise RuntimeError("RemoteRolloutBackend.begin(rollout) must run before the first sync")
        t0 = time.perf_counter()
        waited, sent = 0.0, 0
        with torch.no_grad(), gathered_for_generation(self.module, self.policy):
            if self.sender is not None:
                try:
                    waited = self.sender.send(version, self.module.state_dict(), time.monotonic() + self.bound_s,
                                              evaluate=evaluate)
                    sent = self.sender.bytes_per_version()
                except (RuntimeError, TimeoutError) as e:  # reported with the samples' status (generate)
                    self.sync_problem = self._send_failure(version, e)
        self.version = version
        seconds = time.perf_counter() - t0
        self.timing = {"publish_s": seconds, "publish_wait_s": waited, "weight_sync_s": seconds,
                       "weight_sync_bytes": float(sent),
                       "weight_sync_buckets": float(len(self.layout.buckets) if sent else 0)}
        return version

    def with_sampling(self, rollout_cfg: RolloutConfig) -> RolloutBackend:
        """The generators' evaluation of the current weights (module docstring); ``rollout_cfg``, the evaluation's
        sampling, is the generators' to apply (they read it from the same run file)."""
        return RemoteEvaluation(self)

    def _send_failure(self, version: int, e: BaseException) -> tuple[str, int | None]:
        """Why trainer 0 could not send version ``version`` (the generators' owner named), and the generator that
        hangs (None: it is gone)."""
        peers = self.role.peers
        generators = [self.role.generator_global_rank(i) for i in range(self.role.generators)]
        if isinstance(e, TimeoutError):
            frozen = [g for g in generators if peers is not None and peers.state(g) == FROZEN]
            who = (frozen or generators)[0]
            return (f"{self.role.describe(who)} did not take the weights of rollout {version + 1} within "
                    f"{self.bound_s:.0f} s (0.9 x dsrl.run.collective_timeout_s): it "
                    f"{'is frozen (its process is stopped)' if frozen else 'hangs'}", who)
        gone = self.role.obituary()
        return ((gone or "a generator rank is gone") + f" while the weights of rollout {version + 1} were sent "
                f"({describe_failure(e)})", None)

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        """This replica's completions of the current rollout, as its generator sent them (module docstring)."""
        t0 = time.perf_counter()
        rollout = self.version + 1  # as the console counts rollouts
        msg = self.receive(self.receiver, f"samples for rollout {rollout}", f"rollout {rollout}")
        wait_s = time.perf_counter() - t0
        self.timing.update(wait_s=wait_s, generation_s=msg.generation_s if msg else 0.0,
                           idle_s=msg.idle_s if msg else 0.0)
        if msg is None:
            return []
        self._check(msg, prompt_ids, samples_per_prompt)
        return msg.completions

    def receive(self, receiver: SampleReceiver | None, what: str, where: str) -> SampleMessage | None:
        """The next message of ``receiver`` (a source trainer's; None elsewhere), within the bound; a failed weights
        send, a generator that hangs or is gone, or a stop request while waiting, is agreed on by every trainer and
        raised as :class:`GenerationStopped`. ``what`` / ``where``: the awaited message and the run's point."""
        status, msg, hung = "ok", None, None
        if self.sync_problem is not None:
            status, hung = self.sync_problem
        elif receiver is not None:
            def requested() -> bool:
                return self.stop is not None and self.stop.requested_at is not None

            try:
                msg = receiver.receive(time.monotonic() + self.bound_s, requested)
                if msg is None and not requested():
                    hung = self.owner
                    state = self.role.peers.state(self.owner) if self.role.peers is not None else None
                    status = (f"{self.role.describe(self.owner)} sent no {what} within "
                              f"{self.bound_s:.0f} s (0.9 x dsrl.run.collective_timeout_s): it "
                              f"{'is frozen (its process is stopped)' if state == FROZEN else 'hangs'}")
                elif msg is None:
                    status = "stopped"
            except RuntimeError as e:  # the connection closed: the generator died
                status = (f"{self.role.describe(self.owner)} is gone while {where} was expected "
                          f"({describe_failure(e)})")
        statuses: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(statuses, (status, hung))
        problems = [s for s, _ in statuses if s != "ok"]
        if problems:
            stopped = all(s == "stopped" for s in problems)
            self.lost = not stopped
            text = "a stop was requested while the trainers waited for samples" if stopped else next(
                s for s in problems if s != "stopped")
            raise GenerationStopped(text + "; the trainer side commits a checkpoint and stops (resume with --resume "
                                    "auto once every rank is healthy)", requested=stopped,
                                    hung=sorted({h for _, h in statuses if h is not None}))
        return msg

    def _check(self, msg: SampleMessage, prompt_ids: list[list[int]], samples_per_prompt: int) -> None:
        rollout = self.version
        k = self.plan.max_staleness
        if msg.rollout != rollout or msg.replica != self.replica:
            raise RuntimeError(f"expected rollout {rollout + 1} of replica {self.replica} from "
                               f"{self.role.describe(self.owner)}, got rollout {msg.rollout + 1} of replica "
                               f"{msg.replica}")
        if rollout - msg.version > k or msg.version > rollout:
            raise RuntimeError(f"rollout {rollout + 1} arrived generated with version {msg.version}, outside the "
                               f"staleness bound k = {k} (dsrl.algorithm.max_staleness)")
        same_prompts(msg, prompt_ids, samples_per_prompt, f"{self.role.describe(self.owner)} generated other prompts "
                     f"than the trainer drew for rollout {rollout + 1} of replica {self.replica}: the two sides' "
                     "prompt streams diverged (dsrl.data / dsrl.run.seed must be the same on every rank)")

    def take_timing(self) -> dict[str, float]:
        out, self.timing = self.timing, {}
        return out

    def close(self) -> None:
        """Trainer 0 sends the stop message (generators exit when they read it); errors are ignored (a generator
        may already be gone). After a lost or hung generator it waits 2 s at most instead of 30 (the others end at
        the stop message or at their own bound)."""
        if self.sender is None or not self.role.started:
            return
        patience = 2.0 if self.lost else 30.0
        with contextlib.suppress(Exception):
            self.sender.send(self.version if self.version is not None else self.start_version, None,
                             time.monotonic() + patience)
            self.sender.drain(time.monotonic() + patience)


def same_prompts(msg: SampleMessage, prompt_ids: list[list[int]], samples_per_prompt: int, problem: str) -> None:
    """The message holds ``samples_per_prompt`` completions of each of ``prompt_ids``, in order; else ``problem``."""
    want = [list(p) for p in prompt_ids for _ in range(samples_per_prompt)]
    if [list(c.prompt_ids) for c in msg.completions] != want:
        raise RuntimeError(problem)


class RemoteEvaluation(RolloutBackend):
    """One evaluation by the generator ranks (the module docstring's last rule), as the evaluator sees a backend:
    ``sync_weights`` publishes the current weights for evaluation (every trainer: a collective gather under ZeRO-3),
    ``generate`` returns this replica's completions of one evaluation call as its generator sent them."""

    def __init__(self, remote: RemoteRolloutBackend):
        self.remote = remote
        self.version: int | None = None

    def sync_weights(self) -> None:
        r = self.remote
        self.version = r.publish(evaluate=True)
        r.ahead = True  # the next rollout generates with this version: nothing more to publish

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        r = self.remote
        if self.version is None:
            raise RuntimeError("RemoteEvaluation.sync_weights() must run before generate()")
        msg = r.receive(r.eval_receiver, f"evaluation completions of version {self.version}",
                        f"the evaluation after rollout {self.version}")
        if msg is None:
            return []
        if msg.rollout != self.version or msg.replica != r.replica:
            raise RuntimeError(f"expected the evaluation of version {self.version} for replica {r.replica} from "
                               f"{r.role.describe(r.owner)}, got version {msg.rollout} of replica {msg.replica}")
        same_prompts(msg, prompt_ids, samples_per_prompt, f"{r.role.describe(r.owner)} evaluated other prompts than "
                     f"the trainers for replica {r.replica}: the two sides' evaluation prompts differ (dsrl.eval, "
                     "dsrl.data and dsrl.run.seed must be the same on every rank)")
        return msg.completions
