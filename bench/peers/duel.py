"""The duel's TRL side and its one compute thread: ``TRLStepper`` steps TRL's own
``GRPOTrainer.train()`` loop from outside (``trl_args``: grpo_fast's settings, field by field), and
``ComputeThread`` runs all of both tools' compute on one OS thread. What each side runs and what is
made equal: ``bench/peers/workloads.py``.
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from bench.peers.workloads import Case, Problem, StepRecord


class _RecordingReward:
    """A TRL reward function (``completions, **columns -> list[float]``) over the case's reward,
    keeping each call's mean (one call per step)."""

    def __init__(self, reward_fn):
        self.reward_fn = reward_fn
        self.means: list[float] = []
        self.__name__ = "reward"

    def __call__(self, completions, answer, **kwargs) -> list[float]:
        rewards = [self.reward_fn(c, a)["reward"] for c, a in zip(completions, answer)]
        self.means.append(sum(rewards) / len(rewards))
        return rewards


def trl_args(case: Case, output_dir: str, device: torch.device):
    """``GRPOConfig`` with grpo_fast's settings (``tiny_config``), field by field."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=case.batch,  # completions per step
        num_generations=case.group_size,
        gradient_accumulation_steps=1,
        num_iterations=1,  # one optimizer step per rollout batch: no π_old forward
        max_completion_length=case.max_tokens,
        generation_kwargs={"min_new_tokens": case.min_tokens} if case.min_tokens else None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=case.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="grpo",  # per-sequence token mean, then the mean over sequences
        scale_rewards="group",
        epsilon=0.2,
        max_steps=case.steps,
        shuffle_dataset=False,  # the prompts in the dataset's order: the same as grpo_fast's
        bf16=False,  # GRPOConfig defaults to bf16; grpo_fast's tiny preset is fp32
        fp16=False,
        use_cpu=device.type == "cpu",
        gradient_checkpointing=False,  # GRPOConfig defaults to True; the tiny preset does not checkpoint
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )


class DuelClosed(RuntimeError):
    """Raised inside TRL's held loop when the duel's ``ComputeThread`` closes: the loop ends there
    rather than run another step and wait at its next gate for ever."""


class ComputeThread:
    """The one OS thread that runs all of a duel's compute: the warm start, both tools' models,
    every step of each and the evaluations (``run``), TRL's own ``Trainer.train()`` loop among them.

    Why one thread: torch's CPU ops run their parallel regions on an OpenMP team, and libgomp keeps
    a team per calling thread. With two tools computing from two threads (TRL's loop in its own, as
    it must be, and grpo_fast on the main thread) a 2-core machine holds 4 OpenMP threads, and
    libgomp then throttles its spin-wait (more threads than cores): every parallel region wakes
    its worker through the kernel. Measured on 2 cores after both had run steps: a ``[256, 24]``
    softmax 6.7 → 84 µs, a ``[256, 128] @ [128, 256]`` matmul 53 → 135 µs, grpo_fast's tiny step
    66 → 123 ms (TRL's alike) — a cost of the duel, which one tool alone in its process never
    pays. On this thread both tools share one team, as each would alone.
    """

    _STOP = object()

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self.serve, daemon=True, name="duel-compute")
        self._thread.start()

    def submit(self, fn: Callable, *args) -> threading.Event:
        """Queue ``fn(*args)``; the returned event is set once it has run (result in ``_box``)."""
        done = threading.Event()
        done._box = {}  # type: ignore[attr-defined]
        self._jobs.put((fn, args, done))
        return done

    def run(self, fn: Callable, *args):
        """``fn(*args)`` on the compute thread (directly when called from it), its result or error."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        done = self.submit(fn, *args)
        done.wait()
        if "error" in done._box:
            raise done._box["error"]
        return done._box["value"]

    def serve(self, until: object = None) -> None:
        """Run queued jobs until the ``until`` token is queued (``resume``); the thread's own loop
        runs until ``close``. TRL's step gate serves here while its loop is held."""
        while True:
            job = self._jobs.get()
            if job is self._STOP and until is not None:  # closed while TRL's loop is held here:
                self._jobs.put(self._STOP)  # the thread's own loop stops too,
                raise DuelClosed("the duel's compute thread was closed")  # and train() ends now
            if job is self._STOP or (until is not None and job is until):
                return
            fn, args, done = job
            try:
                done._box["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller of run()
                done._box["error"] = exc
            finally:
                done.set()

    def resume(self, token: object) -> None:
        """Let the ``serve(until=token)`` in progress return."""
        self._jobs.put(token)

    def close(self) -> None:
        self._jobs.put(self._STOP)
        self._thread.join(timeout=60)


class OnThread:
    """A stepper whose ``step()`` runs on the duel's ``ComputeThread``; its attributes are the
    stepper's."""

    def __init__(self, stepper, compute: ComputeThread):
        self.__dict__["_stepper"], self.__dict__["_compute"] = stepper, compute

    def step(self):
        return self._compute.run(self._stepper.step)

    def __getattr__(self, name):
        return getattr(self._stepper, name)

    def __setattr__(self, name, value):
        setattr(self._stepper, name, value)


class TRLStepper:
    """TRL's ``GRPOTrainer.train()`` as a job of the duel's ``ComputeThread``, held at each
    ``on_step_end`` by a callback that serves the thread's other jobs meanwhile (grpo_fast's steps
    among them): ``step()`` lets it run exactly one loop iteration (the previous step's
    bookkeeping, the next batch, generation and scoring, the loss, backward, clip and optimizer
    step) and waits until it stops again, so the two tools never run at the same time. Construct it
    on the compute thread (``compute.run(TRLStepper, problem, device, compute)``).

    The rollout phase is TRL's ``_generate_and_score_completions`` (generate, decode, rewards,
    advantages), timed by wrapping that method on the instance: a reach-in into TRL 1.16's
    internals, kept to this one attribute.
    """

    name = "trl"

    def __init__(self, problem: Problem, device: torch.device, compute: ComputeThread):
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOTrainer

        case = problem.case
        self.problem = problem
        self.model = problem.model(device)
        self.reward = _RecordingReward(problem.reward_fn)
        self._tmp = tempfile.TemporaryDirectory(prefix="trl-peer-")
        data = Dataset.from_dict({"prompt": problem.prompts, "answer": problem.answers})
        self._compute, self._go = compute, object()  # the token that lets the held loop go on
        self._stopped = threading.Semaphore(0)
        self._error: BaseException | None = None
        self._finished = False
        stepper = self

        class Gate(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                stepper._stopped.release()
                compute.serve(until=stepper._go)  # the other jobs run here while TRL is held

        self.trainer = GRPOTrainer(
            model=self.model,
            reward_funcs=[self.reward],
            args=trl_args(case, self._tmp.name, device),
            train_dataset=data,
            processing_class=problem.tokenizer,
            callbacks=[Gate()],
        )
        generate = self.trainer._generate_and_score_completions
        self._rollout_s = 0.0

        def timed_generate(inputs):
            t0 = time.perf_counter()
            out = generate(inputs)
            self._rollout_s += time.perf_counter() - t0
            return out

        self.trainer._generate_and_score_completions = timed_generate
        self._started = False
        self.records: list[StepRecord] = []

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as exc:
            self._error = exc
        finally:
            self._finished = True
            self._stopped.release()

    def step(self) -> StepRecord:
        if self._finished:
            raise RuntimeError("TRL's loop has finished: the case has no more steps")
        self._rollout_s = 0.0
        t0 = time.perf_counter()
        if not self._started:
            self._started = True
            self._compute.submit(self._train)  # runs the first step, then holds at the gate
        else:
            self._compute.resume(self._go)
        self._stopped.acquire()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()  # sync point: TRL's optimizer step may still be queued at on_step_end
        step_s = time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        rec = StepRecord(step_s, self._rollout_s, step_s - self._rollout_s, self.reward.means[-1])
        self.records.append(rec)
        return rec

    def close(self) -> None:
        """Let the loop run to its end (it does not step again once ``max_steps`` is reached)."""
        if self._started and not self._finished:
            while not self._finished:
                self._compute.resume(self._go)
                self._stopped.acquire()
        self._tmp.cleanup()
