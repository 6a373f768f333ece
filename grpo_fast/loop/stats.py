"""A step's statistics: token-level sums over its microbatches (``StepStats``), their totals over
all ranks (one all-reduce), and the metrics row the step logs (``step_metrics``).

Every loss quantity comes from the loss op's output (``GRPOLossOutput``: the loss and its parts,
the clipped tokens and the side of the range they left, the entropy threshold); nothing here
recomputes what the op computed. The sums stay on the device until the end of the step.
"""

from __future__ import annotations

import math
import time

import torch

from grpo_fast import dist
from grpo_fast.algo.token_loss import GRPOLossOutput, kl_penalty
from grpo_fast.obs.metrics import gpu_stats, peak_memory_gb
from grpo_fast.policy.batch import Microbatch

FIELDS = (
    "loss",
    "entropy",
    "clipped",
    "kl_ref",  # Σ KL(π ‖ π_ref) per token, when there is a reference
    "kl_old",  # Σ k3 of KL(π_old ‖ π), when there is a π_old
    "tokens",
    "sampler_gap",  # Σ |log p_trainer − log p_sampler|
    "clip_low",  # clipped with r < 1
    "clip_high",  # clipped with r > 1
    "loss_pg",  # Σ w·pg
    "loss_kl",  # Σ w·β·KL
    "loss_entropy",  # −Σ w·c·H
    "entropy_threshold",  # Σ over microbatches (loss.top_entropy_quantile < 1)
    "microbatches",
    "sft_nll",  # sft.mix_coef: Σ of −log p / N over the solution tokens (N: over all ranks)
    "sft_tokens",
    "value_loss",  # loss.advantage=gae: Σ w·½·(clipped) squared error of the value head
    "value_clipped",  # tokens whose clipped value branch was the larger
    "value_tokens",
)


class StepStats:
    """Token-level sums over the microbatches of one epoch, by name (``FIELDS``)."""

    FIELDS = FIELDS

    def __init__(self):
        self.sums: dict[str, torch.Tensor] | None = None
        self.grad_norm = float("nan")
        self.value_grad_norm: float | None = None  # the value head's, apart (loss.advantage=gae)
        self.has_ref = False
        self.nonfinite = ""  # "loss" / "grad_norm" / both: that step's optimizer step was skipped

    def _add_row(self, row: dict[str, torch.Tensor]) -> None:
        self.sums = row if self.sums is None else {k: self.sums[k] + row[k] for k in FIELDS}

    def add(self, out: GRPOLossOutput, mb: Microbatch) -> None:
        """A GRPO microbatch: its loss op's output ``out`` and the microbatch ``mb``."""
        zero = torch.zeros((), device=out.entropy.device)
        self.has_ref = out.kl is not None
        row = dict.fromkeys(FIELDS, zero)
        row["tokens"] = torch.tensor(float(mb.labels.numel()), device=zero.device)
        row["microbatches"] = torch.ones((), device=zero.device)
        row["loss"] = out.loss.detach().float()
        row["entropy"] = out.entropy.sum()
        row["clipped"] = out.clipped.float().sum()
        if out.kl is not None:
            row["kl_ref"] = out.kl.sum()
        if mb.old_logprobs is not None:
            # KL(π_old ‖ π) from samples of π_old: k3 with d = log π_old − log π is e^(−d) − 1 + d
            row["kl_old"] = kl_penalty(mb.old_logprobs, out.logprobs.detach(), "k3").sum()
            # the side of the range a clipped ratio left it on (on-policy nothing is clipped)
            row["clip_low"] = out.clipped_low.float().sum()
            row["clip_high"] = out.clipped_high.float().sum()
        # the trainer-vs-sampler gap on the sampled tokens, from this forward's log-probs: no extra pass
        if mb.sampler_logprobs is not None:
            row["sampler_gap"] = (out.logprobs - mb.sampler_logprobs).abs().sum()
        row["loss_pg"], row["loss_kl"], row["loss_entropy"] = out.parts  # Σ w·pg, Σ w·β·KL, −Σ w·c·H
        if out.entropy_threshold is not None:  # the op's own quantile of the entropies it computed
            row["entropy_threshold"] = out.entropy_threshold.float()
        if out.value_loss is not None:  # the value head's (loss.advantage=gae)
            row["value_loss"] = out.value_loss.detach().float()
            row["value_clipped"] = out.value_clipped.float().sum()
            row["value_tokens"] = row["tokens"]
        self._add_row(row)

    def add_sft(self, out: GRPOLossOutput, mb: Microbatch, mix_coef: float) -> None:
        """A supervised microbatch: its weights are mix_coef / N, so −Σ w·log p / mix_coef is its
        share of the per-token mean NLL."""
        zero = torch.zeros((), device=out.logprobs.device)
        row = dict.fromkeys(FIELDS, zero)
        row["sft_nll"] = -(mb.loss_weights * out.logprobs.detach()).sum() / mix_coef
        row["sft_tokens"] = torch.tensor(float(mb.labels.numel()), device=zero.device)
        self._add_row(row)

    def _values(self) -> dict[str, float]:
        if self.sums is None:
            return dict.fromkeys(FIELDS, 0.0)
        return dict(zip(FIELDS, torch.stack([self.sums[k] for k in FIELDS]).tolist()))  # sync

    def kl_to_old(self, world: dist.DistInfo, device: torch.device) -> float:
        s = dict(zip(FIELDS, dist.all_reduce_sum(list(self._values().values()), device, axis=world.ranks)))
        return s["kl_old"] / max(s["tokens"], 1.0)

    def global_totals(
        self, world, device, raw_rewards, rollout, reward_meta, skipped_tokens: int = 0, reward_parts=()
    ) -> dict:
        """The step's totals over all ranks (one all-reduce), as means where they are means. Every
        rank's figures are its own: its rollout (under sequence parallelism too, ``loop/sp_group.py``)
        and the training tokens it held (an sp rank: its slice of each sequence). ``reward_parts``:
        the names of a weighted reward's parts (``Task.reward_parts``), each score's
        ``"reward/NAME"``, averaged into ``train/reward/NAME``."""
        r = raw_rewards.double()
        n = len(raw_rewards)
        local = {
            **self._values(),
            "reward_sum": r.sum().item(),
            "reward_sq": (r * r).sum().item(),
            "correct": sum(t.correct for t in rollout.trajectories),  # task.rewards.correct
            "formatted": reward_meta.get("format_reward_mean", float("nan")) * n,
            "truncated": sum(f == "length" for f in rollout.finish_reason),
            "sequences": n,
            "zero_variance_groups": reward_meta["zero_variance_groups"],
            "groups": reward_meta["num_groups"],
            "skipped": skipped_tokens,
            "kl_reward_sum": reward_meta.get("kl_reward_sum", 0.0),
            "kl_reward_tokens": reward_meta.get("kl_reward_tokens", 0.0),
        }
        # a weighted reward's parts (data.reward a list): each response's "reward/NAME", summed here
        parts = sorted(f"reward/{name}" for name in reward_parts)
        local.update({f"part:{p}": sum(float(t.scores[p]) for t in rollout.trajectories) for p in parts})
        g = dict(zip(local, dist.all_reduce_sum(list(local.values()), device, axis=world.ranks)))
        return _means(
            g, parts, self.has_ref, "kl_reward_sum" in reward_meta, rollout.sampler_logprobs is not None
        )


def _means(g: dict, parts: list[str], has_ref: bool, kl_in_reward: bool, has_sampler: bool) -> dict:
    """The global sums ``g`` as the step's totals: means where they are means."""
    tokens = max(g["tokens"], 1.0)  # the trained ones
    nseq = g["sequences"]
    mean = g["reward_sum"] / nseq
    var = max(g["reward_sq"] / nseq - mean * mean, 0.0) * nseq / max(nseq - 1, 1)  # unbiased, as torch.std
    return {
        "loss": g["loss"],
        "entropy": g["entropy"] / tokens,
        "clip_fraction": g["clipped"] / tokens,
        "clip_fraction_low": g["clip_low"] / tokens,
        "clip_fraction_high": g["clip_high"] / tokens,
        "loss_pg": g["loss_pg"],
        "loss_kl": g["loss_kl"],
        "loss_entropy": g["loss_entropy"],
        "entropy_threshold": g["entropy_threshold"] / max(g["microbatches"], 1.0),
        # KL to the reference policy: in the loss, or (loss.kl_in_reward) k1 per sampled token
        # in the rollout phase; else to π_old (0 when on-policy)
        "kl": (
            g["kl_reward_sum"] / max(g["kl_reward_tokens"], 1.0)
            if kl_in_reward
            else (g["kl_ref"] if has_ref else g["kl_old"]) / tokens
        ),
        "reward_parts": {f"train/{p}": g[f"part:{p}"] / nseq for p in parts},
        "sft": {"train/sft_loss": g["sft_nll"], "train/sft_tokens": g["sft_tokens"]}
        if g["sft_tokens"]
        else {},
        "reward_mean": mean,
        "reward_std": math.sqrt(var),
        "accuracy": g["correct"] / nseq,
        "format_rate": g["formatted"] / nseq,
        "truncated": g["truncated"] / nseq,
        "zero_variance": g["zero_variance_groups"] / max(g["groups"], 1),
        "sampler_gap": g["sampler_gap"] / tokens if has_sampler else None,
        "skipped": g["skipped"] / max(g["tokens"] + g["skipped"], 1.0),
        "value": {
            "train/value_loss": g["value_loss"],
            "train/value_clip_fraction": g["value_clipped"] / g["value_tokens"],
        }
        if g["value_tokens"]
        else {},
    }


def close_step(run, step: int, batch, result, started: float) -> dict[str, float]:
    """After step ``step``'s optimizer step (``batch`` the rollout phase's ``RolloutBatch``,
    ``result`` the optimization phase's): its totals over all ranks (one all-reduce), the adaptive
    β and entropy coefficient, the step counter; returns the metrics row (``started``: the step's
    ``perf_counter`` start, for ``time/step_s``)."""
    cfg, state = run.cfg, run.trainer.state
    totals = result.stats.global_totals(
        run.world,
        run.device,
        batch.raw_rewards,
        batch.rollout,
        batch.reward_meta,
        result.skipped_tokens,
        reward_parts=run.task.reward_parts,
    )
    if run.trainer.kl_ctl is not None:  # β follows the KL it penalizes (in the loss, or in the rewards)
        state.set_beta(run.trainer.kl_ctl.update(totals["kl"], int(result.counts["seqs"])))
    if cfg.loss.entropy_target is not None:  # the entropy coefficient follows the mean entropy
        state.update_entropy_coef(totals["entropy"], cfg.loss)  # (all ranks' mean: one value)
    state.finish_step(step, applied=not result.stats.nonfinite)
    return step_metrics(run, step, batch, result, totals, time.perf_counter() - started)


def step_metrics(run, step: int, batch, result, totals: dict, step_s: float) -> dict[str, float]:
    """The step's metrics row from its totals (``StepStats.global_totals``); reads the run's state
    (β after this step's update), changes nothing."""
    cfg, world, device, state = run.cfg, run.world, run.device, run.trainer.state
    c = result.counts
    out = {
        "train/loss": totals["loss"],
        "train/reward_mean": totals["reward_mean"],
        "train/reward_std": totals["reward_std"],
        "train/accuracy": totals["accuracy"],
        "train/format_rate": totals["format_rate"],
        "train/entropy_mean": totals["entropy"],
        "train/response_length_mean": c["all_tokens"] / max(c["all_seqs"], 1),
        "train/truncated_fraction": totals["truncated"],
        "train/zero_variance_fraction": totals["zero_variance"],
        "train/skipped_fraction": totals["skipped"],
        **_reward_errors(cfg, batch.reward_fn, device, world.ranks),
        "train/grad_norm": result.stats.grad_norm,
        **(
            {"train/value_grad_norm": result.stats.value_grad_norm}
            if result.stats.value_grad_norm is not None
            else {}
        ),
        "train/clip_fraction": totals["clip_fraction"],
        "train/clip_fraction_low": totals["clip_fraction_low"],  # clipped with r < 1
        "train/clip_fraction_high": totals["clip_fraction_high"],  # clipped with r > 1
        "train/loss_pg": totals["loss_pg"],  # train/loss = loss_pg + loss_kl + loss_entropy
        "train/loss_kl": totals["loss_kl"],
        "train/loss_entropy": totals["loss_entropy"],
        # the top_entropy_quantile threshold, mean over microbatches (0 when off)
        "train/entropy_threshold": totals["entropy_threshold"],
        "train/kl": totals["kl"],
        "train/beta": run.trainer.state.beta,
        # loss.entropy_target: the adaptive coefficient after this step's update
        **({"train/entropy_coef": state.entropy_coef} if state.entropy_coef is not None else {}),
        "train/lr": result.lr,
        "train/temperature": batch.temperature,
        "time/rollout_s": batch.seconds,
        "time/train_s": result.seconds,
        "time/step_s": step_s,
        "memory/peak_gb": peak_memory_gb(device),
        "throughput/tokens_per_s": (c["all_tokens"] + c["prompt_tokens"]) / step_s,
        "world_size": world.world_size,
        **totals["reward_parts"],
        **totals["sft"],  # sft.mix_coef: the supervised term's per-token NLL (not in train/loss)
        **totals["value"],  # loss.advantage=gae: the value head's loss (not in train/loss)
        **_rollout_metrics(run.rollout.backend, totals),
        **batch.extra,
        **result.extra,
        **gpu_stats(device),
    }
    if "time/teacher_s" in out:  # distill.teacher: the teacher passes' share of the step
        out["time/teacher_share"] = out["time/teacher_s"] / step_s
    return out


def _reward_errors(cfg, reward_fn, device: torch.device, axis: dist.Axis) -> dict[str, float]:
    """``train/reward_errors``: responses scored 0 because the reward function failed, over all
    ranks (with ``data.reward_errors=zero`` only: otherwise the first failure stopped the run)."""
    if cfg.data.reward_errors != "zero":
        return {}
    return {
        "train/reward_errors": dist.all_reduce_sum([reward_fn.errors], device, axis=axis)[0]
    }  # host-device sync


def _rollout_metrics(backend, totals: dict) -> dict[str, float]:
    """Sampler-side health: the weight-sync probe of the latest push, and the trainer-vs-sampler
    gap on the sampled tokens (both only when the backend provides them)."""
    row = {}
    if getattr(backend, "weight_sync_abs_diff", None) is not None:
        row["rollout/weight_sync_abs_diff"] = backend.weight_sync_abs_diff
    if totals.get("sampler_gap") is not None:
        row["rollout/logprob_abs_diff"] = totals["sampler_gap"]
    return row
