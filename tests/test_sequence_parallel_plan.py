"""The planner under ``train.sequence_parallel=N``: a rank plans ⌈L/N⌉ tokens of each sequence plus
one layer's all-to-all buffers; the longest response that fits a card for N = 1, 2, 4, 8 is the
longest whose plan fits; the dry run prints them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from grpo_fast.config import AUTO, load_config
from grpo_fast.tools import plan

ARCH = plan.KNOWN_ARCHS["Qwen/Qwen2.5-Math-1.5B"]  # D 1,536, 28 layers, 12 heads / 2 KV heads of 128


def _with(cfg, **train):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def _rollout(cfg, max_tokens: int):
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_tokens=max_tokens))


def test_a_rank_plans_its_share_of_each_sequence_and_the_exchange_buffers():
    """rtx4090 (bf16, gradient checkpointing): 28·1,536·2 = 86,016 B of layer inputs + one layer
    recomputed (10·1,536 + 4·8,960)·2 = 102,400 + the fp32 hidden states and their gradient 12,288
    = 200,704 B a token; N = 2 adds q, k, v and the output sent and received,
    2·(1,536 + 2·256 + 1,536)·2 = 14,336 B; a rank holds ⌈1,536 / 2⌉ = 768 tokens of each sequence."""
    cfg = load_config("rtx4090", check_device=False)
    one = plan.plan_memory(_with(cfg, micro_batch_size=2), ARCH, 24 * plan.GB)
    two = plan.plan_memory(_with(cfg, micro_batch_size=2, sequence_parallel=2), ARCH, 24 * plan.GB, 2)
    assert one.activation_per_token == 200_704
    assert two.activation_per_token == 200_704 + 14_336
    assert one.activations == 200_704 * 1536 * 2
    assert two.activations == (200_704 + 14_336) * 768 * 2
    assert "× 768 (1/2 of 1536) × 2" in two.table() and "× 1536 × 2" in one.table()
    # fewer key/value heads than ranks: each repeated to one a rank (N = 4: 4 heads of 128 sent)
    four = plan.activation_per_token(_with(cfg, sequence_parallel=4), ARCH)
    assert four == 200_704 + 2 * (1536 + 2 * 4 * 128 + 1536) * 2
    # the automatic microbatch takes the rank's share: with twice the room a sequence, more fit
    auto = _with(cfg, micro_batch_size=AUTO)  # 24 GB − 21.6 GB fixed: 7 sequences of 1,536 tokens, 14 halves
    assert plan.plan_memory(auto, ARCH, 24 * plan.GB).micro_batch_size == 7
    assert plan.plan_memory(_with(auto, sequence_parallel=2), ARCH, 24 * plan.GB, 2).micro_batch_size == 14


@pytest.mark.parametrize("card", [24, 80])
def test_the_longest_response_is_the_longest_whose_plan_fits(card):
    cfg = load_config("rtx4090", check_device=False)
    rows = {r["size"]: r for r in plan.sequence_parallel_table(cfg, ARCH)}
    assert [n for n in (1, 2, 4, 8) if rows[n]["fits"]] == [1, 2, 4]  # 12 heads do not split over 8
    for n in (1, 2, 4):
        longest = rows[n]["longest"][card]
        sized = _with(cfg, micro_batch_size=1, sequence_parallel=n)
        fits = plan.plan_memory(_rollout(sized, longest), ARCH, card * plan.GB, n)
        over = plan.plan_memory(_rollout(sized, longest + n), ARCH, card * plan.GB, n)
        assert fits.train_peak <= card * plan.GB < over.train_peak, (n, longest)
    # each doubling of N nearly doubles the sequence (prompt + response): a little less, the
    # all-to-all buffers being per token too
    tokens = {n: rows[n]["longest"][card] + cfg.rollout.max_prompt_tokens for n in (1, 2, 4)}
    assert 1.8 < tokens[2] / tokens[1] < 2.0 and 1.8 < tokens[4] / tokens[2] < 2.0


def test_the_activations_per_rank_halve_with_each_doubling():
    cfg = _rollout(load_config("rtx4090", check_device=False), 8192)
    rows = {r["size"]: r for r in plan.sequence_parallel_table(cfg, ARCH)}
    seq = cfg.rollout.max_prompt_tokens + 8192
    for n in (1, 2, 4):
        per_token = plan.activation_per_token(_with(cfg, sequence_parallel=n), ARCH)
        assert rows[n]["activations"] == per_token * math.ceil(seq / n)
    assert rows[2]["activations"] < 0.54 * rows[1]["activations"]


def test_the_dry_run_prints_the_sequence_parallel_lines(tmp_path, capsys):
    from grpo_fast.tools.dry_run import dry_run

    dry_run("rtx4090", [], [f"output_dir={tmp_path / 'run'}", "train.sequence_parallel=2"])
    out = capsys.readouterr().out
    lines = out[out.index("sequence parallelism (train.sequence_parallel=N; now 2)") :].splitlines()
    assert lines[1].startswith("  N = 1:") and "GB per rank; longest response" in lines[1]
    assert "tokens on 24 GB" in lines[2] and "tokens on 80 GB" in lines[2]
    assert lines[4] == "  N = 8: not possible (12 attention heads, 2 key/value heads)"
    assert not (tmp_path / "run").exists()
