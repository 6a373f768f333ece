"""How to sample, from the config: one ``SamplingParams`` builder, the per-step seeds, the RNG fork.

``sampling_params`` is the one place a ``SamplingParams`` is built from ``rollout.*`` (the
training rollouts and the evaluation alike); ``step_seed`` gives each (run seed, step, rank,
round) its own sampling seed, so that a resumed run samples what the straight run sampled;
``sampling_rng`` seeds torch's RNG with it around an hf ``generate``.
"""

from __future__ import annotations

import contextlib
import zlib

import numpy as np
import torch

from grpo_fast.rollout.base import SamplingParams

__all__ = ["eval_seed", "sampling_params", "sampling_rng", "step_seed"]


def sampling_params(
    rollout_cfg,
    stop: tuple[str, ...] | list[str] = (),
    *,
    n: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    for_eval=False,
) -> SamplingParams:
    """``SamplingParams`` from the ``rollout`` config section.

    Training (default): ``n = rollout.group_size`` responses at ``temperature`` (default
    ``rollout.temperature``; the loop passes it with the health monitor's boost),
    ``rollout.top_p``, ``rollout.top_k``, ``rollout.min_tokens``..``rollout.max_tokens`` new tokens.
    ``for_eval``: the ``eval`` section (``grpo_fast.config.EvalConfig``; ``True``: its defaults,
    one greedy response): ``eval.k`` responses at ``eval.temperature``
    (``EvalConfig.sampling_temperature``: auto = greedy at k = 1, ``rollout.temperature`` above)
    and ``eval.top_p`` (0 = greedy, then top_p 1 and top_k 0; else ``rollout.top_k``), up to ``eval.max_tokens`` (auto =
    ``rollout.max_tokens``) new tokens, no minimum length.

    Example: ``sampling_params(cfg.rollout, task.stop, seed=step_seed(cfg.seed, step, rank))``.
    """
    r = rollout_cfg
    if for_eval is not False:
        # True: the section's defaults (one greedy answer, rollout.max_tokens)
        k, temp, top_p, most = (
            (1, 0.0, 1.0, "auto")
            if for_eval is True
            else (
                for_eval.k,
                for_eval.sampling_temperature(r.temperature),
                for_eval.top_p,
                for_eval.max_tokens,
            )
        )
        greedy = temp == 0
        return SamplingParams(
            n=k,
            temperature=temp,
            top_p=1.0 if greedy else top_p,
            max_tokens=r.max_tokens if most == "auto" else most,
            min_tokens=0,
            stop=tuple(stop),
            seed=None if greedy else seed,
            top_k=0 if greedy else r.top_k,
        )
    return SamplingParams(
        n=r.group_size if n is None else n,
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        max_tokens=r.max_tokens,
        min_tokens=r.min_tokens,
        stop=tuple(stop),
        seed=seed,
        top_k=r.top_k,
    )


def eval_seed(seed: int, name: str, rank: int) -> int:
    """The sampling seed of eval set ``name`` on ``rank``: the same at every evaluation of a run (the
    steps' figures then differ by the model alone, not by the draws) and in ``grpo-fast evaluate``
    with the same ``seed``; a set's draws do not depend on which other sets are evaluated.

    Example: ``eval_seed(0, "tiny", 0) != eval_seed(0, "tiny_3digit", 0)``; fits in 31 bits.
    """
    entropy = [seed, zlib.crc32(name.encode()), rank, 0xE7A1]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


def step_seed(seed: int, step: int, rank: int, round: int = 0) -> int:
    """A sampling seed for (run seed, step, rank, sampling round): the same after a resume,
    different across ranks and across the extra rounds of dynamic sampling (round 0 is the
    step's first generation, whose seed does not depend on the option).

    Example: ``step_seed(0, 1, 0) != step_seed(0, 1, 1) != step_seed(0, 1, 0, round=1)``; the
    value fits in 31 bits.
    """
    entropy = [seed, step, rank] + ([round] if round else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


@contextlib.contextmanager
def sampling_rng(seed: int | None, device: torch.device):
    """The torch RNG (CPU, and ``device``'s when CUDA) seeded with ``seed`` inside the block and
    restored after it; ``None`` leaves it alone. Data parallel, every rank starts from the same
    RNG state, so hf ``generate`` would draw the same random numbers on every rank: the loop
    seeds each rank's sampling with its own (run seed, step, rank) seed instead. One rank keeps
    its single stream (the same results as before this existed)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield
