"""Generation apart from training: the pipeline (``rollout.max_staleness``, ``rollout.placement``).

Two sides with one boundary. The **producer** (two threads of the training process) owns
generation and scoring: its generating thread takes jobs in step order, loads the policy version
each job names into a backend with weights of its own (``grpo_fast.rollout.hf``: a copy in this
process, or the decoder in a worker process; or the run's vLLM engine apart, pushed and probed)
and runs ``generate_production`` (prompts → groups); its scorer thread scores each batch in job
order (``score_production``: the rewards) while the next is generated, and delivers it. Neither
runs a collective or reads anything of the trainer. The **trainer** (the main thread) owns the optimizer: it takes step k's batch,
finalizes it (``rollout_phase.finalize``: shaping, advantages), trains on it and publishes its new
weights. Between them, under one lock: the jobs, the finished batches (the queue) and the staged
weight versions — every trajectory that crosses carries the version that sampled it.

**Versions.** Step j's batch is sampled by policy version ``need(j) = max(j − 1 − S, first)``:
the weights after optimizer step j − 1 − S (S = ``rollout.max_staleness``; ``first``: the step
this process started from). With S = 1 the producer generates step k + 1 from the weights of
step k − 1 while the trainer trains step k, and ``rollout/policy_lag`` (the largest
``step − 1 − policy_version`` of the batch) is 1; with S = 0 it generates step k + 1 once step k's
weights are published (lockstep with the generation in its own process). The schedule does not
depend on timing: a run is reproducible and a resume exact. A batch whose trajectories say they
are older than that (``lag > S``: an engine that did not take its weights) is refused, logged and
generated again from the trainer's current weights; a second refusal stops the run.

**Publishing** step k's weights is the backend's host copy of them (``stage``: the trainable
parameters; for vLLM what a push sends and the probe's reference log-probs; ``time/weight_sync_s``); the producer loads them into its backend before the first job that
needs them (``time/weight_load_s``, off the trainer's path). ``time/wait_trainer_s``: how long
the trainer waited for its batch; ``time/wait_producer_s``: how long the producer waited for the
weights of its next job; ``time/produce_s``: the batch's generation and scoring (the scoring
overlaps the next batch's generation: with a reward that waits, staleness 1 took 0.93-0.95x
lockstep's step with the two in series, 0.80x with them overlapped; docs/rollout.md).

**Waits and stops.** The trainer waits for a batch at most ``rollout.request_timeout`` seconds;
the worker's start, rollouts and weight loads have their own limits (``rollout.start_timeout``,
``request_timeout``, ``sync_timeout``). What the producer raises (a dead worker, a wait past its
limit, a reward error) reaches the trainer where it waits for that batch. SIGTERM/SIGINT: the
producer stops after its current chunk, the trainer where it waits (or at its step's end, as in
lockstep). A stop or a failed engine writes the checkpoint of the last finished step first.

**Checkpoints** (``checkpoint_state``) hold what a resume needs to replay the same batches: the
jobs after the checkpoint's step (step, policy version, temperature), the trainable weights of
the versions they sample with (older than the checkpoint's own: at most S copies), and the prompt
sampler as it was before the first of them drew. A resume generates them again from there.

**Under torchrun** each rank runs its producer on its share of the prompts; the trainers agree on
each batch (``_collect``: one all-reduce of the lag, so that every rank refuses a stale batch
together, and of a failure flag, so that a producer that failed on one rank stops every rank, an
engine's failure with the step's checkpoint written by all: ``grpo_fast.loop.agreement``). A checkpoint keeps a job until the
trainers agreed on its batch. One vLLM server for all ranks: the run's ``VLLMBackend`` (the producers
push over a group of their own, ``grpo_fast.rollout.vllm.placement.ranks``). The hf producers sample from
a whole copy of the policy: refused under FSDP.

Not with the pipeline (``config_checks_rollout._check_pipeline``): dynamic sampling (extra rounds inside a
step), and with S > 0 the options that have the producer read the pass rates the trainer records,
and the colocated vLLM engine.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from grpo_fast import threads as cpu_threads
from grpo_fast.errors import ConfigError, EngineTimeout, TrainingStopped
from grpo_fast.loop import preempt
from grpo_fast.loop.agreement import agree
from grpo_fast.loop.checkpointing import resume_point
from grpo_fast.loop.producer import Production, generate_production, score_production
from grpo_fast.loop.rollout_phase import RolloutBatch, finalize, record_pass_rates
from grpo_fast.loop.state import RolloutSide, Run
from grpo_fast.loop.step import train as train_steps
from grpo_fast.obs.metrics import PhaseProgress
from grpo_fast.rollout import Rollout
from grpo_fast.rollout import backend as backend_spec
from grpo_fast.rollout.fleet import Fleet
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.rollout.hf.copied import HFCopyBackend, weights_digest
from grpo_fast.rollout.hf.process import (
    HFProcessBackend,
    Timeouts,
    shared_buffers,
    worker_payload,
    worker_threads,
)


def train(run: Run, progress: PhaseProgress) -> None:
    """The pipelined outline: ``grpo_fast.loop.step.train`` with the pipeline as the source (the
    batch from the producer, finalized; the new weights staged for it)."""
    with Pipeline.start(run) as pipe:
        train_steps(run, pipe, progress)


@dataclass
class Job:
    """One batch to produce: step ``step``'s, sampled by policy version ``version`` at
    ``temperature``; ``prompts``: given (a batch generated again), else drawn."""

    step: int
    version: int
    temperature: float
    prompts: tuple[int, ...] | None = None

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "version": self.version,
            "temperature": self.temperature,
            "prompts": self.prompts,
        }

    @classmethod
    def from_state_dict(cls, d: dict) -> Job:
        prompts = None if d["prompts"] is None else tuple(int(i) for i in d["prompts"])
        return cls(int(d["step"]), int(d["version"]), float(d["temperature"]), prompts)


@dataclass
class Produced:
    """A batch the producer finished: its ``Rollout`` (scored), the job's temperature, its batch
    reward function, and what the producer's side measured."""

    job: Job
    rollout: Rollout
    reward_fn: object
    seconds: float  # generation + scoring (the scoring beside the next batch's generation)
    wait_s: float  # the producer's wait for this job (its weights)
    load_s: float  # loading the job's weights into the backend (0 when it held them)
    fleet: dict[str, float] = field(default_factory=dict)  # a fleet's metrics over this batch
    wait_trainer_s: float = 0.0  # the trainer's wait for it
    lag: int = 0  # optimizer steps between its oldest sampling weights and the trainer's (_collect)

    @property
    def temperature(self) -> float:
        return self.job.temperature


class _Stopped(BaseException):
    """The producer was asked to stop (raised at its next chunk's end)."""


class _Quiet:
    """The producer's progress: no bars (the trainer's thread shows its own); each chunk's end
    is where a stop request or a signal ends the job."""

    def __init__(self, stop: threading.Event):
        self.stop = stop

    def phase(self, name: str, total: int) -> None:
        pass

    def advance_phase(self, n: int = 1) -> None:
        if self.stop.is_set():
            raise _Stopped


@dataclass
class _Shared:
    """What both sides touch, under ``Pipeline.cond``."""

    jobs: list[Job] = field(default_factory=list)  # to produce, in order
    posted: dict[int, Job] = field(default_factory=dict)  # every job not yet taken by the trainer
    done: dict[int, Produced] = field(default_factory=dict)
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # staged weights
    before: dict[int, dict] = field(default_factory=dict)  # the sampler's state before job j drew
    error: BaseException | None = None
    doing: str = "starting"  # what the producer is at, for a timeout's message
    # generated batches (or a job's failure) in job order, for the scorer thread: batch k is
    # scored while batch k + 1 is generated
    to_score: list[tuple] = field(default_factory=list)
    scoring: int | None = None  # the step whose batch the scorer is scoring


class Pipeline:
    """The producer's thread and the state the two sides share (module docstring). ``start`` it
    with the run as it is after setup (resumed or not); ``close`` stops the producer and its
    backend."""

    def __init__(self, run: Run, backend):
        self.run, self.backend = run, backend
        # a vLLM engine apart is the run's (closed at its end) and serves an older policy than
        # the trainer's: evaluations meanwhile generate with the hf decoder on the trainer's model
        self.owns_backend = backend is not run.rollout.backend
        self.eval_backend = None
        if not self.owns_backend:
            cfg = run.cfg.rollout
            self.eval_backend = HFBackend(run.model, run.tokenizer, cfg.generation_batch_size, run.amp)
        self.S = run.cfg.rollout.max_staleness
        self.first = run.trainer.state.step
        self.cond = threading.Condition()
        self.shared = _Shared()
        self.stop = threading.Event()
        self.publish_s = 0.0
        self._loaded = False  # whether the backend has had a version loaded (a resume re-syncs first)
        self.refused: set[int] = set()  # steps whose batch was refused once
        self.produced: Produced | None = None  # the batch the trainer took last
        # the producer's side: the run's prompt sampler and pass rates, the pipeline's backend
        self.side = RolloutSide(
            backend, run.rollout.sampler, run.rollout.pass_rates, run.rollout.prompts_per_rank
        )
        self.thread = threading.Thread(target=self._loop, name="grpo_fast-producer", daemon=True)
        self.scorer = threading.Thread(target=self._score_loop, name="grpo_fast-scorer", daemon=True)

    # ------------------------------------------------------------------ the trainer's side

    @classmethod
    @contextlib.contextmanager
    def start(cls, run: Run):
        """The pipeline of ``run``, producing from the start, closed after the block."""
        r = run.cfg.rollout
        if (
            run.world.enabled
            and run.cfg.train.parallelism == "fsdp"
            and not backend_spec(r.backend).needs_weight_push
        ):
            raise ConfigError(
                f"rollout.backend={r.backend} with rollout.max_staleness={r.max_staleness} / rollout.placement="
                f"{r.placement} samples from a whole copy of the policy, which FSDP shards: use "
                "train.parallelism=ddp, or rollout.backend=vllm with rollout.placement=server"
            )
        threads, pipe = torch.get_num_threads(), None
        try:
            pipe = cls(run, producer_backend(run))
            pipe._post_first_jobs()
            run.pipeline = pipe
            pipe.thread.start()
            pipe.scorer.start()
            yield pipe
        finally:
            run.pipeline = None
            if pipe is not None:
                pipe.close()
            torch.set_num_threads(threads)

    def need(self, step: int) -> int:
        """The policy version that samples ``step``'s batch."""
        return max(step - 1 - self.S, self.first)

    def _stage(self, version: int) -> None:
        """The trainer's weights now, as policy version ``version``: the backend's host copy of
        them (``stage``: the trainable parameters; for a vLLM engine what a push sends, with the
        probe's reference log-probs); the producer loads it when a job needs it."""
        staged = self.backend.stage(self.run.model)
        with self.cond:
            self.shared.versions[version] = staged

    def _temperature(self, step: int) -> float:
        """``step``'s sampling temperature, decided now (the health monitor's boost, rank 0's)."""
        return self.run.cfg.rollout.temperature + self.run.health.shared_temperature_boost(step)

    def _post(self, job: Job, front: bool = False) -> None:
        with self.cond:
            self.shared.posted[job.step] = job
            self.shared.jobs.insert(0, job) if front else self.shared.jobs.append(job)
            self.cond.notify_all()

    def _post_first_jobs(self) -> None:
        """The checkpoint's in-flight jobs with their versions' weights, then the jobs that
        version ``first`` (the weights now) samples."""
        self._stage(self.first)
        restored = self.run.rollout.in_flight or {}
        for version, tensors in restored.get("versions", {}).items():
            self.shared.versions[int(version)] = tensors
        jobs = [Job.from_state_dict(d) for d in restored.get("jobs", [])]
        self.run.rollout.in_flight = None
        if jobs and jobs[0].step != self.first + 1:
            raise ConfigError(  # a batch nobody would produce: the trainer would wait for it
                f"the checkpoint of step {self.first} holds in-flight batches from step {jobs[0].step}, "
                f"not {self.first + 1}: it cannot be resumed with the pipeline"
            )
        if any(j.version not in self.shared.versions for j in jobs):
            raise ConfigError(  # a checkpoint written by another max_staleness (run_folder refuses it first)
                f"the checkpoint's in-flight batches need weights it does not hold (rollout.max_staleness={self.S})"
            )
        for job in jobs:
            self._post(job)
        nxt = jobs[-1].step + 1 if jobs else self.first + 1
        for step in range(nxt, min(self.first + self.S + 1, self.run.cfg.steps) + 1):
            self._post(Job(step, self.need(step), self._temperature(step)))

    def next_batch(self, step: int, progress: PhaseProgress | None = None) -> Produced:
        """Step ``step``'s batch, once the producer has it: waits at most ``rollout.request_timeout``
        seconds; raises what the producer raised; a batch older than ``rollout.max_staleness`` is
        refused and generated again (once). A signal ends the wait (``preempt.Interrupt``)."""
        if progress is not None:
            progress.phase("rollout (producer)", 1)
        t0 = time.monotonic()
        produced, lag, newest = self._collect(step)
        if lag > self.S or newest > step - 1:
            produced = self._refuse(step, produced, lag)
        produced.wait_trainer_s = time.monotonic() - t0
        if progress is not None:
            progress.advance_phase(1)
        return produced

    def _collect(self, step: int) -> tuple[Produced, int, int]:
        """``step``'s batch from this rank's producer, with the largest lag and newest version of
        every rank's batch (one all-reduce under torchrun, so that every rank refuses a batch, or
        stops, together). A producer that failed on one rank stops every rank: its own error there,
        elsewhere one that names the rank (an ``EngineError`` stays one, so that every rank writes
        the step's checkpoint together)."""
        try:
            produced, error = self._wait_for(step), None
        except BaseException as exc:  # every rank raises together (agreement.agree)
            produced, error = None, exc
        lag, newest = self._lag(step, produced.rollout) if produced is not None else (0, 0)
        if produced is not None:
            produced.lag = lag  # this rank's, for rollout/policy_lag; every rank's largest below
        lag, newest = agree(self.run.agree, self.run.world, error, [lag, newest], "rollout producer")
        self._taken(step)
        return produced, int(lag), int(newest)

    def _taken(self, step: int) -> None:
        """``step``'s job is the trainer's now: a checkpoint no longer holds it (until then, a
        stop on any rank leaves it to the resume)."""
        with self.cond:
            del self.shared.posted[step]

    def _wait_for(self, step: int) -> Produced:
        limit = self.run.cfg.rollout.request_timeout
        t0 = time.monotonic()
        with self.cond:
            while step not in self.shared.done:
                if self.shared.error is not None:
                    raise self.shared.error
                preempt.check_unit()  # a signal: stop waiting
                waited = time.monotonic() - t0
                if waited >= limit:
                    doing = (
                        f"scoring step {step}'s batch" if self.shared.scoring == step else self.shared.doing
                    )
                    raise EngineTimeout(
                        f"the rollout producer did not deliver step {step}'s batch within "
                        f"rollout.request_timeout={limit:g} s (it was {doing})"
                    )
                self.cond.wait(min(0.1, limit - waited))
            return self.shared.done.pop(step)

    @staticmethod
    def _lag(step: int, rollout: Rollout) -> tuple[int, int]:
        """(the largest lag of the batch's trajectories, in optimizer steps; their newest version)."""
        versions = [t.policy_version for t in rollout.trajectories]
        return step - 1 - min(versions), max(versions)

    def _refuse(self, step: int, produced: Produced, lag: int) -> Produced:
        """A batch sampled by too old a policy (or by one the trainer has not made): logged,
        generated again for the same prompts from the trainer's weights now; refused twice,
        the run stops."""
        versions = sorted({t.policy_version for t in produced.rollout.trajectories})
        what = (
            f"step {step}'s rollout batch was sampled by policy version(s) {versions}: {lag} optimizer "
            f"step(s) behind the trainer's {step - 1} (rollout.max_staleness={self.S})"
        )
        if step in self.refused:
            raise TrainingStopped(
                f"{what}, again after it was generated from version {step - 1}: the rollout backend is not "
                f"taking the weights it is given; {resume_point(self.run, step - 1)}"
            )
        self.refused.add(step)
        self.run.logger.event(f"{what}: refused, generated again from version {step - 1}")
        self._stage(step - 1)
        prompts = tuple(g.example_index for g in produced.rollout.groups)
        self._post(Job(step, step - 1, produced.temperature, prompts), front=True)
        again, lag, newest = self._collect(step)
        if lag > self.S or newest > step - 1:
            return self._refuse(step, again, lag)
        return again

    def publish(self, step: int) -> None:
        """Step ``step``'s weights to the producer (staged: a host copy of the trainable
        parameters), and the job they sample (step + S + 1); versions no job needs are dropped."""
        t0 = time.perf_counter()
        self._stage(step)
        with self.cond:
            keep = self.need(step + 1)
            for version in [v for v in self.shared.versions if v < keep]:
                del self.shared.versions[version]
            for j in [j for j in self.shared.before if j <= step]:
                del self.shared.before[j]
        nxt = step + self.S + 1
        if nxt <= self.run.cfg.steps:
            self._post(Job(nxt, self.need(nxt), self._temperature(nxt)))
        self.publish_s = time.perf_counter() - t0

    def batch(self, step: int, progress: PhaseProgress, started: float) -> RolloutBatch:
        """``step``'s batch from the producer (``next_batch``), its groups in the pass-rate table,
        finalized (``rollout_phase.finalize``: shaping, advantages)."""
        produced = self.produced = self.next_batch(step, progress)
        record_pass_rates(self.run, produced.rollout)  # the pass-rate table, when an option keeps one
        return finalize(self.run, produced.rollout, {}, produced.temperature, produced.reward_fn, started)

    def metrics(self, step: int) -> dict[str, float]:
        """The step's pipeline metrics (module docstring), of the batch ``batch`` returned last."""
        produced = self.produced
        return {
            "rollout/policy_lag": float(produced.lag),
            "time/wait_trainer_s": produced.wait_trainer_s,
            "time/wait_producer_s": produced.wait_s,
            "time/produce_s": produced.seconds,
            "time/weight_sync_s": self.publish_s,
            "time/weight_load_s": produced.load_s,
            **produced.fleet,
        }

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint of step ``step`` holds of the pipeline (module docstring): ``sampler``
        (the prompt sampler before the first job after ``step`` drew) and ``pipeline`` (those
        jobs, the weights of their versions older than ``step``)."""
        with self.cond:
            jobs = [self.shared.posted[j] for j in sorted(self.shared.posted) if j > step]
            versions = {j.version: self.shared.versions[j.version] for j in jobs if j.version != step}
            drawn = [j.step for j in jobs if j.step in self.shared.before]
            sampler = self.shared.before[drawn[0]] if drawn else self.run.rollout.sampler.state_dict()
        return {
            "sampler": sampler,
            "pipeline": {
                "max_staleness": self.S,
                "jobs": [j.state_dict() for j in jobs],
                "versions": versions,
            },
        }

    def close(self) -> None:
        """Stop the producer (at its current chunk's end) and the backend it started (a worker is
        ended; the run's engine is the run's)."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        if self.owns_backend:
            self.backend.close()
        for thread in (self.thread, self.scorer):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5.0)

    # ------------------------------------------------------------------ the producer's side

    def _take(self) -> tuple[Job, float] | None:
        """The next job and how long it waited for it; None once stopped."""
        t0 = time.monotonic()
        with self.cond:
            self.shared.doing = "waiting for the trainer's weights"
            while not self.shared.jobs or self.stop.is_set():
                if self.stop.is_set():
                    return None
                self.cond.wait(0.5)
            job = self.shared.jobs.pop(0)
            if job.prompts is None:  # it draws: the sampler before it, for a checkpoint
                self.shared.before[job.step] = self.side.sampler.state_dict()
            self.shared.doing = f"producing step {job.step}'s batch"
            return job, time.monotonic() - t0

    def _loop(self) -> None:
        """Jobs in order until stopped, each generated here and handed to the scorer thread,
        which scores it while the next is generated; whatever a job raises goes to the scorer
        in its place, so that the trainer meets it after the batches before it."""
        try:
            while not self.stop.is_set():
                taken = self._take()
                if taken is None:
                    return
                try:
                    item = self._generate(*taken)
                except _Stopped:
                    return
                except BaseException as exc:  # handed to the trainer, after the batches before it
                    item = (taken[0], exc)
                with self.cond:
                    self.shared.to_score.append(item)
                    self.cond.notify_all()
                if isinstance(item[1], BaseException):
                    return
        except BaseException as exc:  # the loop itself failed
            with self.cond:
                self.shared.error = exc
                self.cond.notify_all()

    def _generate(self, job: Job, wait_s: float) -> tuple:
        """One job's batch, unscored: its version's weights into the backend (unless it holds
        them), then ``generate_production``; with what the trainer's metrics take from it."""
        load_s = 0.0
        if self.backend.version != job.version or not self._loaded:
            with self.cond:
                tensors = self.shared.versions[job.version]
            t0 = time.perf_counter()
            self.backend.load_weights(tensors, job.version)
            load_s, self._loaded = time.perf_counter() - t0, True
        run = self.run
        reward_fn = run.task.reward_fn.for_batch(job.step)
        t0 = time.perf_counter()
        production = Production(job.step, 0, job.temperature, reward_fn, prompts=job.prompts)
        rollout = generate_production(
            self.side, run.cfg, run.task, run.world, run.device, production, _Quiet(self.stop)
        )
        fleet = self.backend.take_metrics() if isinstance(self.backend, Fleet) else {}
        return job, rollout, production, time.perf_counter() - t0, wait_s, load_s, fleet

    def _score_loop(self) -> None:
        """The generated batches scored in job order (``score_production``) and delivered to the
        trainer; a job's failure, or the scorer's, is kept for the trainer."""
        try:
            while True:
                with self.cond:
                    while not self.shared.to_score and not self.stop.is_set():
                        self.cond.wait(0.5)
                    if self.stop.is_set():
                        return
                    item = self.shared.to_score.pop(0)
                    if isinstance(item[1], BaseException):
                        self.shared.error = item[1]
                        self.cond.notify_all()
                        return
                    self.shared.scoring = item[0].step
                job, rollout, production, gen_s, wait_s, load_s, fleet = item
                t0 = time.perf_counter()
                score_production(rollout, production, self.run.cfg)
                seconds = gen_s + time.perf_counter() - t0
                produced = Produced(job, rollout, production.reward_fn, seconds, wait_s, load_s, fleet=fleet)
                with self.cond:
                    self.shared.done[job.step] = produced
                    self.shared.scoring = None
                    self.cond.notify_all()
        except BaseException as exc:  # handed to the trainer, which raises it
            with self.cond:
                self.shared.error = exc
                self.cond.notify_all()


def producer_backend(run: Run):
    """The producer's backend, with weights of its own: the run's vLLM engine apart,
    the hf decoder in a worker process (``rollout.placement=process``; the trainer's torch
    threads are cut to the CPUs the worker leaves), or a copy of the policy in this process."""
    r = run.cfg.rollout
    if backend_spec(r.backend).needs_weight_push:
        return run.rollout.backend  # the run's own: it stays awake and lives as long as the run
    if r.placement == "process":
        threads = worker_threads(r.worker_threads, workers=r.num_engines)
        cpus = len(os.sched_getaffinity(0))
        left = max(1, cpus - threads * r.num_engines)
        torch.set_num_threads(max(1, min(torch.get_num_threads(), left)))
        if (
            cpu_threads.follower is not None
        ):  # a count following the machine: never above what the workers leave
            cpu_threads.follower.most = min(cpu_threads.follower.most, left)
        timeouts = Timeouts(r.start_timeout, r.request_timeout, r.sync_timeout)
        if r.num_engines > 1:
            return hf_fleet(run, threads, timeouts)
        return HFProcessBackend(
            run.model,
            run.tokenizer,
            r.generation_batch_size,
            threads=threads,
            timeouts=timeouts,
            autocast_dtype=run.amp,
        )
    return HFCopyBackend(run.model, run.tokenizer, r.generation_batch_size, run.amp)


def hf_fleet(run: Run, threads: int, timeouts: Timeouts) -> Fleet:
    """``rollout.num_engines`` hf workers as one backend (``grpo_fast.rollout.fleet``): one set of
    shared-memory buffers they all read a version from, written once per version; each load
    probed by the digest of the worker's parameters."""
    r = run.cfg.rollout
    payload = worker_payload(run.model, run.tokenizer, r.generation_batch_size, run.amp)
    shm = shared_buffers(run.model)

    def start(i: int) -> HFProcessBackend:
        return HFProcessBackend(
            run.model, run.tokenizer, r.generation_batch_size, threads=threads, timeouts=timeouts,
            payload=payload, shm=shm, name=str(i),
        )  # fmt: skip

    def share(tensors: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
        for name, value in tensors.items():
            shm[name].copy_(value)
        return weights_digest(shm)

    return Fleet(
        start,
        share,
        lambda worker, digest, version: worker.load_shared(version, digest),
        HFProcessBackend.stage,
        num_engines=r.num_engines,
        min_engines=r.min_engines,
        generation_batch_size=r.generation_batch_size,
        warn=run.logger.event,
        what="hf rollout worker",
    )
