"""The run's state, in two sides: the trainer side (``Trainer``: the loss module, optimizer,
schedule, reference, KL controller, and ``TrainState``, what changes from step to step) and the
rollout side (``RolloutSide``: the backend, the prompt sampler, the pass-rate table); ``Run``
holds both and what setup loaded (fixed after it).

Each side changes only through named transitions: the producer draws prompts
(``RolloutSide.draw``), the step's finalize records pass rates (``record_pass_rates``), the
outline pushes weights between the sides (``sync_weights``) and updates β, the entropy
coefficient and the step counter (``TrainState``'s methods); the end of the step updates the
health monitor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_fast import dist
from grpo_fast.algo.control import AdaptiveKLController, adaptive_entropy_coef, applied_entropy_coef
from grpo_fast.algo.difficulty import PassRateTable
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.prompt_sampler import PromptSampler
from grpo_fast.config import Config
from grpo_fast.obs.health import HealthMonitor
from grpo_fast.obs.metrics import MetricsLogger
from grpo_fast.policy import parallel
from grpo_fast.rollout.base import sync_weights
from grpo_fast.rollout.registry import backend
from grpo_fast.task.loader import Task


@dataclass
class TrainState:
    """What changes from step to step. ``step``, ``beta`` and the adaptive entropy coefficient
    survive a resume (``state_dict``); ``nonfinite_run`` counts the steps in a row whose update
    was not applied (a run stops after ``train.max_nonfinite_steps`` of them) and starts from 0
    in each process. ``entropy_coef``: the adaptive entropy controller's coefficient
    (``loss.entropy_target``; None without it), ``entropy_last`` the mean token entropy it last
    saw (inf before the first step)."""

    step: int = 0
    beta: float = 0.0
    nonfinite_run: int = 0
    entropy_coef: float | None = None
    entropy_last: float = math.inf

    def set_beta(self, beta: float) -> None:
        """The adaptive KL controller's new β (``loss.target_kl``)."""
        self.beta = float(beta)

    def update_entropy_coef(self, entropy: float, loss_cfg) -> None:
        """The adaptive entropy controller after a step whose mean token entropy over all ranks
        was ``entropy`` (``loss.entropy_target``, ``entropy_coef_step``, ``entropy_coef_max``):
        the same on every rank, since every rank passes the step's global mean."""
        lo = loss_cfg
        self.entropy_coef = adaptive_entropy_coef(
            self.entropy_coef, entropy, lo.entropy_target, lo.entropy_coef_step, lo.entropy_coef_max
        )
        self.entropy_last = float(entropy)

    def finish_step(self, step: int, applied: bool) -> None:
        """Step ``step`` is done; ``applied``: its optimizer step ran (False: a non-finite loss
        or gradient norm skipped it)."""
        self.step = step
        self.nonfinite_run = 0 if applied else self.nonfinite_run + 1

    def state_dict(self) -> dict[str, float]:
        state = {"step": self.step, "beta": self.beta}
        if self.entropy_coef is not None:
            state.update(entropy_coef=self.entropy_coef, entropy_last=self.entropy_last)
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> TrainState:
        entropy = {}
        if "entropy_coef" in state:
            entropy = dict(
                entropy_coef=float(state["entropy_coef"]), entropy_last=float(state["entropy_last"])
            )
        return cls(step=int(state["step"]), beta=float(state["beta"]), **entropy)


@dataclass
class Trainer:
    """The trainer side of a run: what the optimization phase works with and the state only it
    changes. The loss module (``PolicyLoss``, DDP-wrapped when data parallel), the optimizer and
    its trainable parameters, where it runs; the LR schedule, the reference policy, the KL
    controller and ``state`` (``TrainState``: changed by its methods, at the end of each step).

    Tests and benchmarks that drive ``optimize_on_rollout`` give the first six fields only."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    cfg: Config
    world: dist.DistInfo = field(default_factory=dist.DistInfo)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # sft.mix_coef > 0: the plain NLL module on the same model (the supervised microbatches)
    sft_loss: torch.nn.Module | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    policy_loss: torch.nn.Module | None = None  # PolicyLoss itself (no DDP): no-grad passes, the probe
    ref_model: torch.nn.Module | None = None
    ref_loss: torch.nn.Module | None = None
    kl_ctl: AdaptiveKLController | None = None
    state: TrainState = field(default_factory=TrainState)
    # loss.advantage=gae: the value head (in policy_loss; its parameters train with params)
    value_head: torch.nn.Module | None = None
    # distill.teacher: the frozen teacher's loss module (its per-token log-probs; no gradients), or
    # under distill.placement=server its vLLM server (grpo_fast.policy.teacher.ServedTeacher)
    teacher_loss: Any = None

    def loss_options(self) -> LossOptions:
        """This step's loss options: ``loss.*`` with the current β (0 with ``loss.kl_in_reward``:
        the KL is in the rewards then) and, with ``loss.entropy_target``, the adaptive entropy
        coefficient (0 while the last step's entropy was above the target)."""
        lo, s = self.cfg.loss, self.state
        options = lo.loss_options().with_beta(0.0 if lo.kl_in_reward else s.beta)
        if s.entropy_coef is None:
            return options
        return options.with_entropy_coef(
            applied_entropy_coef(s.entropy_coef, s.entropy_last, lo.entropy_target)
        )

    def scoring_options(self) -> LossOptions:
        """The options of the no-grad passes that only read log-probs (π_old, π_ref, the KL in
        the reward, the weight-sync probe): ``loss.*`` with β = 0, so that no reference is needed."""
        return self.cfg.loss.loss_options().with_beta(0.0)


@dataclass
class RolloutSide:
    """The rollout side of a run: what the producer owns and changes. The backend (and the
    weights it was last given), the prompt sampler's position and the per-prompt pass rates,
    each changed only by the transitions below; nothing here reaches the trainer."""

    backend: object
    sampler: PromptSampler
    pass_rates: PassRateTable | None = None  # per-prompt pass rates, when an option uses them
    prompts_per_rank: int = 0  # prompts per step each rank generates (dist.DistInfo.ranks)
    # a pipelined run's in-flight work as its checkpoint recorded it (grpo_fast.loop.pipeline:
    # the jobs after the checkpoint's step, the weights of the versions they sample with); None
    # for a fresh run or a lockstep checkpoint
    in_flight: dict | None = None

    def draw(self, step: int, dp: dist.Axis) -> list[int]:
        """This rank's prompts of ``step`` (indices into the training set), ``dp`` the axis they
        split over (``DistInfo.ranks``: every rank): every rank draws the whole step's prompts from
        its copy of the sampler (the same on all), then takes its share; no communication."""
        n = self.prompts_per_rank
        return self.sampler.next(n * dp.size, step=step)[dp.rank * n : (dp.rank + 1) * n]

    def record_pass_rates(self, groups: list[tuple[list[int], list[list[float]]]]) -> None:
        """The pass-rate table sees every rank's scored groups (``(indices,
        per-group correctness)`` per rank, gathered by the step): the tables stay equal."""
        if self.pass_rates is not None:
            for indices, correct in groups:
                self.pass_rates.update(indices, correct)

    def sync_weights(self, model: torch.nn.Module, step: int) -> None:
        """The backend serves the weights of optimizer step ``step``: staged and loaded at once
        (``grpo_fast.rollout.base.sync_weights``; vllm: push + weight-sync probe, which may stop
        the run; hf: nothing to move, it samples from ``model``)."""
        sync_weights(self.backend, model, step)


@dataclass
class Run:
    """One training run from setup to the final model: what setup loaded and built (fixed after
    it), the two sides (``trainer``, ``rollout``) and the run-wide helpers."""

    cfg: Config
    device: torch.device
    world: dist.DistInfo
    out: Path
    logger: MetricsLogger
    task: Task
    tokenizer: object
    model: torch.nn.Module
    amp: torch.dtype | None
    trainer: Trainer
    rollout: RolloutSide
    health: HealthMonitor
    # eval.sets, loaded (grpo_fast.task.eval_sets.EvalSet: each with its task and fixed subset)
    eval_sets: list
    sft_steps: int = 0
    # the pipeline while a pipelined run trains (grpo_fast.loop.pipeline.Pipeline): what its
    # checkpoints record of the producer's side; None in lockstep
    pipeline: object | None = None
    # under torchrun, the gloo group the ranks agree on each unit of rollout work over
    # (grpo_fast.loop.agreement); None in a world of one
    agree: object | None = None

    @property
    def eval_subset_size(self) -> int:
        """Problems the subset evaluation (``eval_every``) grades, over every set (0: none)."""
        return sum(len(s.subset) for s in self.eval_sets)

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    def eval_backend(self):
        """The backend evaluations generate with: the rollout backend, except while a pipeline
        feeds a vLLM engine apart, which serves an older policy than the trainer's: then the hf
        decoder on the trainer's model (``pipeline.Pipeline.eval_backend``)."""
        apart = getattr(self.pipeline, "eval_backend", None)
        return self.rollout.backend if apart is None else apart

    def generation_weights(self):
        """A context for a phase that generates: under FSDP with a backend that samples from the
        training model itself (hf), every unit gathered for its length
        (``parallel.generation_weights``); a no-op otherwise (a backend with its own weights,
        vllm, needs none of the trainer's)."""
        own = backend(self.cfg.rollout.backend).needs_weight_push
        return parallel.generation_weights(None if own else self.trainer.policy_loss)
