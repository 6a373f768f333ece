"""The run's state: what setup built (``Run``, fixed after it), the optimizer side (``Trainer``),
and what changes from step to step (``TrainState``, changed only by its methods).

The stateful helpers a run holds (the prompt sampler, the health monitor, the KL controller, the
pass-rate table) change through their own methods, in the phase that owns them: the rollout
phase draws prompts and updates the pass rates, the loop's outline updates β, the end of the
step updates the health monitor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo_fast import dist
from grpo_fast.algo.core import AdaptiveKLController, adaptive_entropy_coef, applied_entropy_coef
from grpo_fast.algo.difficulty import PassRateTable
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.prompt_sampler import PromptSampler
from grpo_fast.config import Config
from grpo_fast.obs.health import HealthMonitor
from grpo_fast.obs.metrics import MetricsLogger
from grpo_fast.policy import fsdp
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
    """What the optimization phase works with: the loss module (``PolicyLoss``, DDP-wrapped when
    data parallel), the optimizer and its trainable parameters, and where it runs."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    cfg: Config
    world: dist.DistInfo = field(default_factory=dist.DistInfo)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # sft.mix_coef > 0: the plain NLL module on the same model (the supervised microbatches)
    sft_loss: torch.nn.Module | None = None


@dataclass
class Run:
    """One training run from setup to the final model: what setup loaded and built (fixed after
    it), the stateful helpers, and ``state``."""

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
    scheduler: torch.optim.lr_scheduler.LRScheduler
    policy_loss: torch.nn.Module  # PolicyLoss itself (no DDP): the no-grad passes and the probe
    ref_model: torch.nn.Module | None
    ref_loss: torch.nn.Module | None
    sampler: PromptSampler
    health: HealthMonitor
    kl_ctl: AdaptiveKLController | None
    state: TrainState
    eval_subset: list
    backend: object = None  # the rollout backend (set last by setup: it needs the rest)
    pass_rates: PassRateTable | None = None  # per-prompt pass rates, when an option uses them
    sft_steps: int = 0
    local_prompts: int = 0  # prompts per step on this rank

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    def generation_weights(self):
        """A context for a phase that generates: under FSDP with a backend that samples from the
        training model itself (hf), every unit gathered for its length (``fsdp.gathered``); a
        no-op otherwise (a backend with its own weights, vllm, needs none of the trainer's)."""
        if backend(self.cfg.rollout.backend).needs_weight_push:
            return fsdp.gathered(None)
        return fsdp.gathered(self.policy_loss)

    def loss_options(self) -> LossOptions:
        """This step's loss options: ``loss.*`` with the current β (0 with ``loss.kl_in_reward``:
        the KL is in the rewards then) and, with ``loss.entropy_target``, the adaptive entropy
        coefficient (0 while the last step's entropy was above the target)."""
        lo = self.cfg.loss
        options = lo.loss_options().with_beta(0.0 if lo.kl_in_reward else self.state.beta)
        if self.state.entropy_coef is None:
            return options
        s = self.state
        return options.with_entropy_coef(
            applied_entropy_coef(s.entropy_coef, s.entropy_last, lo.entropy_target)
        )

    def scoring_options(self) -> LossOptions:
        """The options of the no-grad passes that only read log-probs (π_old, π_ref, the KL in
        the reward, the weight-sync probe): ``loss.*`` with β = 0, so that no reference is needed."""
        return self.cfg.loss.loss_options().with_beta(0.0)
