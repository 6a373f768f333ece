"""The training loop with a tool environment on the hf backend (``--preset tiny_tools``, a few
steps from random weights): the tool metrics and the turns reach the logs and the sample dumps,
``data.tool_error_penalty`` costs each failed call its reward, ``loss.mask_void_turns`` leaves
the responses with a void turn out of the loss."""

from __future__ import annotations

import json

import pytest

import grpo_fast.train as train_mod
from grpo_fast.config import load_config
from grpo_fast.loop import optimization

RESPONSES = 32  # a step's responses: rollout.batch_size


def _run(tmp_path, *extra) -> list[dict]:
    """``tiny_tools`` on hf from random weights (no warm start: the model writes malformed calls,
    void turns and answers), 3 steps; the metrics rows after step 0."""
    cfg = load_config(
        "tiny_tools",
        overrides=[
            f"output_dir={tmp_path}",
            "steps=3",
            "sft.steps=0",
            "eval_every=3",
            "data.eval_subset_size=16",
            f"rollout.batch_size={RESPONSES}",
            "checkpoint_every=0",
            "logging.progress=false",
            "logging.sample_every=1",
            "train.skip_zero_advantage=false",
            *extra,
        ],
    )
    train_mod.run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) > 0 and "event" not in r]


def test_tool_metrics_and_turns_reach_the_logs_and_the_error_penalty_costs_each_failed_call(tmp_path):
    rows = _run(tmp_path, "data.tool_error_penalty=0.5")
    assert [r["step"] for r in rows] == [1, 2, 3]
    failed = [r["rollout/tool_error_fraction"] * r["rollout/tool_calls_mean"] for r in rows]  # per response
    assert sum(failed) > 0, rows  # random weights write bad expressions
    for r, f in zip(rows, failed):
        assert r["rollout/tool_error_penalty_mean"] == pytest.approx(-0.5 * f, abs=1e-6)
        assert 1.0 <= r["rollout/turns_mean"] <= 3.0  # max_tool_calls=2: at most 3 turns
        assert 0.0 <= r["rollout/inserted_token_fraction"] < 1.0
    assert sum(r["rollout/inserted_token_fraction"] for r in rows) > 0
    assert "eval/tool_call_rate" in rows[-1] and "eval/tool_calls_mean" in rows[-1]
    dump = [json.loads(x) for x in (tmp_path / "samples" / "step_3.jsonl").read_text().splitlines()]
    assert len(dump) > 0
    for rec in dump:  # a turn after each call that ran; what came back is the calculator's
        assert len(rec["turns"]) in (rec["tool_calls"], rec["tool_calls"] + 1), rec
        for turn in rec["turns"][:-1]:
            assert turn["inserted"].startswith("<result>") and turn["inserted"].endswith("</result>"), rec
        assert rec["turns"][-1]["inserted"] == "", rec
    unpenalized = _run(tmp_path / "off")
    assert all("rollout/tool_error_penalty_mean" not in r for r in unpenalized)


def test_mask_void_turns_leaves_those_responses_out_of_the_loss(tmp_path, monkeypatch):
    seen = []
    real = optimization.make_microbatches
    monkeypatch.setattr(
        optimization, "make_microbatches", lambda seqs, *a, **k: seen.append(len(seqs)) or real(seqs, *a, **k)
    )
    for masked in ("true", "false"):
        seen.clear()
        rows = _run(tmp_path / masked, f"loss.mask_void_turns={masked}")
        void = [round(r["rollout/void_turn_fraction"] * RESPONSES) for r in rows]
        assert sum(void) > 0, rows  # random weights: some turns end on EOS or </calc> with nothing
        expected = [max(RESPONSES - v, 1) for v in void] if masked == "true" else [RESPONSES] * len(rows)
        assert seen == expected, (masked, seen, void)
