"""Multi-turn rollouts with a tool (grpo_fast/rollout/multi_turn.py, both backends): the tool's
output goes into the row that asked, as inserted tokens after the turn's own sampled ids (never
re-encoded); the caps end a response that never stops calling, each with its finish reason; an
output over its cap is cut with the marker; the sampler's log-probs of a multi-turn response are
the trainer's; inserted tokens get exactly zero gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from tool_oracle import ToolUser

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.env import Environment, OutputLimit, ToolCall, ToolResult, make_environment
from grpo_fast.policy.batch import assign_loss_weights, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.rollout import Role
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.rollout.multi_turn import ToolRollout, Turns, demonstrations
from grpo_fast.rollout.vllm import VLLMBackend
from grpo_fast.task import tiny
from grpo_fast.task.tiny_tools import tiny_tools_reward_fn

S, INS = Role.SAMPLED, Role.INSERTED
QUESTIONS = ["12*34=", "5*678=", "100*200=", "99*99="]  # distinct products


def _tok(merged: bool = False):
    """The tiny_tools tokenizer; ``merged``: with one more token, ``00``, which encoding text
    prefers (``"100"`` → ``1 00``) while the model samples ``1 0 0``."""
    tok = tiny.build_tokenizer(tiny.TOOLS_NAME)
    if merged:
        tok.add_tokens(["00"])
    return tok


def _tools(tok, calls=2, turns=None, out=16, response=64):
    return ToolRollout(make_environment("calculator"), tok, calls, turns or calls + 1, out, response)


def _backend(kind: str, model, tok, tools):
    if kind == "hf":
        return HFBackend(model, tok, 64, tools=tools)
    from test_rollout_vllm import FakeVLLMEngine

    backend = VLLMBackend(FakeVLLMEngine(model, tok), tok, sleep_level=1, tools=tools)
    backend.update_weights(model)
    return backend


@pytest.mark.parametrize("kind", ["hf", "vllm"], ids=["hf", "fake-vllm"])
def test_each_tool_output_goes_into_the_row_that_asked_and_sampled_ids_are_kept(kind):
    tok = _tok(merged=True)
    user = ToolUser(tok, "use")
    rollout = _backend(kind, user, tok, _tools(tok)).generate(
        [tok(q)["input_ids"] for q in QUESTIONS], SamplingParams(2, 1.0, 1.0, 32, 0)
    )
    assert [tok.decode(p) for p in rollout.response_prompt_ids()] == [q for q in QUESTIONS for _ in (0, 1)]
    for q, t in zip([q for q in QUESTIONS for _ in (0, 1)], rollout.trajectories):
        a, b = q.rstrip("=").split("*")
        product = str(int(a) * int(b))
        # the answer is read back from this row's cache: the result was prefilled into it
        assert t.text == f"<calc>{a}*{b}</calc><result>{product}</result>{product}"
        assert tiny_tools_reward_fn(t.text, product)["reward"] == 1.0
        call = user.script(tok(q)["input_ids"])  # one token a character, as the model sampled it
        result = tok(f"<result>{product}</result>", add_special_tokens=False)["input_ids"]
        assert t.token_ids[: len(call)] == call  # not the text re-encoded (that merges "00")
        assert t.token_ids[len(call) : len(call) + len(result)] == result  # the output, tokenized once
        assert t.role_list == [S] * len(call) + [INS] * len(result) + [S] * (
            t.num_tokens - len(call) - len(result)
        )
        assert t.turn_starts == [0, len(call) + len(result)] and t.finish_reason == "stop"
        assert [(c.request, c.ok, c.inserted) for c in t.tool_calls] == [(f"{a}*{b}", True, len(result))]
        assert len(t.sampler_logprobs) == t.num_sampled


@pytest.mark.parametrize("kind", ["hf", "vllm"], ids=["hf", "fake-vllm"])
@pytest.mark.parametrize(
    "caps, reason, calls, turns",
    [
        # 2 calls run; the third request ends it: 3 turns
        (dict(calls=2, turns=9), "max_tool_calls", 2, 3),
        # 0 means zero calls (not unlimited): the first request ends it unrun
        (dict(calls=0, turns=9), "max_tool_calls", 0, 1),
        # the second turn's request ends it unrun: 1 call
        (dict(calls=9, turns=2), "max_turns", 1, 2),
        # 12*34: a call turn is 7 tokens, its output 5: 7 + 5 + 7 = 19 > 18 after the first
        (dict(calls=9, response=18), "max_response_tokens", 1, 2),
    ],
    ids=["tool-calls", "zero-calls", "turns", "response-tokens"],
)
def test_a_model_that_never_stops_calling_ends_at_the_cap(kind, caps, reason, calls, turns):
    tok = _tok()
    rollout = _backend(kind, ToolUser(tok, "loop"), tok, _tools(tok, **caps)).generate(
        [tok("12*34=")["input_ids"]], SamplingParams(2, 1.0, 1.0, 200, 0)
    )
    for t in rollout.trajectories:
        assert (t.finish_reason, len(t.tool_calls), t.num_turns) == (reason, calls, turns)
        assert t.num_tokens <= caps.get("response", 64)


@pytest.mark.parametrize("kind", ["hf", "vllm"], ids=["hf", "fake-vllm"])
def test_the_sampled_token_budget_ends_a_looping_response_as_length(kind):
    tok = _tok()
    rollout = _backend(kind, ToolUser(tok, "loop"), tok, _tools(tok, calls=9, response=200)).generate(
        [tok("12*34=")["input_ids"]], SamplingParams(1, 1.0, 1.0, 10, 0)
    )
    [t] = rollout.trajectories  # 7 sampled in turn 1, 5 inserted, 3 sampled: 10
    assert (t.finish_reason, t.num_sampled, t.num_inserted, len(t.tool_calls)) == ("length", 10, 5, 1)


def test_an_output_over_its_cap_is_cut_with_the_marker_by_the_tool_or_by_the_rollout():
    tok = tiny.build_tokenizer(tiny.TOOLS_NAME)

    class Loud(Environment):  # ignores the limit it is given
        name, stop_strings = "loud", ("</calc>",)

        def parse(self, turn_text):
            return ToolCall("x", "</calc>")

        def execute(self, calls, limit):
            return [ToolResult("<result>" + "7" * 40 + "</result>", True, "ok", False, 0.0) for _ in calls]

    ids = tok("<calc>" + "*".join(["99999999999"] * 4) + "</calc>", add_special_tokens=False)["input_ids"]
    for env in (make_environment("calculator"), Loud()):
        tools = ToolRollout(env, tok, 2, 3, 12, 128)
        turns = Turns(tools, [tok("1*1=")["input_ids"]], SamplingParams(1, 1.0, 1.0, 64, 0))
        inserted = turns.end_turn({0: (ids, [0.0] * len(ids))})
        [call] = turns.rows[0].calls
        assert len(inserted[0]) == call.inserted <= 12 and call.truncated
        assert "characters of output cut" in call.text
        assert tok.decode(inserted[0]) == tok.decode(
            tok(call.text, add_special_tokens=False)["input_ids"][:12]
        )


def test_void_turns_are_counted():
    tok = tiny.build_tokenizer(tiny.TOOLS_NAME)
    tools = _tools(tok)
    eos, close = tok.eos_token_id, tok.convert_tokens_to_ids("</calc>")
    one = tok.convert_tokens_to_ids("1")
    turns = Turns(tools, [tok("1*1=")["input_ids"]] * 3, SamplingParams(1, 1.0, 1.0, 32, 0))
    # EOS with nothing said; the stop string with no request; an answer
    turns.end_turn({0: ([eos], None), 1: ([one, close], None), 2: ([one, eos], None)})
    assert [(r.finish_reason, r.void_turns) for r in turns.rows] == [("stop", 1), ("stop", 1), ("stop", 0)]


def test_demonstrations_insert_the_tools_output_as_context():
    tok = tiny.build_tokenizer(tiny.TOOLS_NAME)
    [t, d] = demonstrations(
        _tools(tok), [tok("12*34=")["input_ids"]] * 2, ["<calc>12*34</calc>408", "408"], 32
    )
    assert t.text == "<calc>12*34</calc><result>408</result>408" and d.text == "408"
    assert t.sampled_ids == tok("<calc>12*34</calc>408", add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id
    ]
    assert t.num_inserted == 5 and d.num_inserted == 0 and d.token_ids[-1] == tok.eos_token_id


def _multi_turn_samples(backend, tok, n=16):
    """Random-weight samples at temperature 1 (~1 in 4 rows calls the calculator: ``<calc>``
    before the first ``</calc>``, whatever it holds), and those with more than one turn."""
    prompts = [tok(q)["input_ids"] for q in QUESTIONS]
    rollout = backend.generate(prompts, SamplingParams(n, 1.0, 1.0, 20, 0, seed=5))
    multi = [t for t in rollout.trajectories if t.num_turns > 1]
    assert len(multi) >= 4
    return rollout.trajectories, multi


def trainer_logprobs(model, trajectories, temperature=1.0):
    """``[S_i]`` per trajectory: the trainer's log-probs of its sampled tokens (the fused op)."""
    loss = PolicyLoss(model, autocast=None, backend="torch_chunked")
    out = []
    with torch.no_grad():
        for t in trajectories:
            [mb] = make_microbatches([t], 1, pad_id=0, packing=False)
            out.append(loss(mb, LossOptions(), temperature).logprobs.double())
    return out


def assert_inserted_tokens_get_no_gradient(model, trajectories):
    """The loss's gradient at the final hidden states: exactly zero wherever the next token is
    not sampled (the prompt, and every position that predicts an inserted token), nonzero where
    it is."""
    model = copy.deepcopy(model)
    loss = PolicyLoss(model, autocast=None, backend="torch_chunked")
    seen = {}

    def keep(module, args, out):  # the final hidden states [1, L, D], their gradient kept
        out.retain_grad()
        seen["h"] = out

    model.model.norm.register_forward_hook(keep)
    for t in trajectories:
        t.advantage = 1.0
    assign_loss_weights(trajectories, length_norm="sequence_mean", max_length=64)
    for t in trajectories:
        [mb] = make_microbatches([t], 1, pad_id=0, packing=False)
        loss(mb, LossOptions(), 1.0).loss.backward()
        grad = seen["h"].grad[0].abs().sum(-1)  # [L]
        p = len(t.prompt_ids)
        predicts = {p - 1 + j: r for j, r in enumerate(t.role_list)}  # position -> the role of the next token
        inserted = [k for k, r in predicts.items() if r == INS]
        assert inserted and (grad[inserted] == 0).all(), f"inserted tokens got gradient: {grad[inserted]}"
        assert (grad[: p - 1] == 0).all()
        assert (grad[[k for k, r in predicts.items() if r == S]] > 0).all()


def test_hf_sampler_logprobs_of_multi_turn_responses_are_the_trainers_and_inserted_get_no_gradient():
    tok = _tok()
    model = tiny.build_model(tok, seed=0)  # fp32
    torch.manual_seed(0)
    _, multi = _multi_turn_samples(HFBackend(model, tok, 64, tools=_tools(tok)), tok)
    for t, ours in zip(multi, trainer_logprobs(model, multi)):
        diff = (torch.tensor(t.sampler_logprobs, dtype=torch.float64) - ours).abs().max()
        assert diff < 1e-5, f"{t.text!r}: |Δ log p| {diff:.2e}"
    assert_inserted_tokens_get_no_gradient(model, multi)


# -- the config keys, end to end -------------------------------------------------------------------


def _cfg(*overrides, preset="tiny_tools"):
    from grpo_fast.config import load_config

    return load_config(preset, overrides=list(overrides), check_device=False)


@pytest.mark.parametrize(
    "overrides, reason, calls, turns",
    [
        (["rollout.max_tool_calls=0"], "max_tool_calls", 0, 1),
        (["rollout.max_tool_calls=1"], "max_tool_calls", 1, 2),
        (["rollout.max_tool_calls=3"], "max_tool_calls", 3, 4),
        (["rollout.max_tool_calls=5", "rollout.max_turns=3"], "max_turns", 2, 3),
        # 7 sampled + 5 inserted + 7 = 19: the second call runs, its 5 tokens do not fit in 20
        (["rollout.max_tool_calls=5", "rollout.max_response_tokens=20"], "max_response_tokens", 2, 2),
        # the 5-token output cut to 3 (the marker's first tokens): no result to copy, it stops
        (["rollout.max_tool_calls=1", "rollout.max_tool_output_tokens=3"], "stop", 1, 2),
    ],
    ids=["calls-0", "calls-1", "calls-3", "turns-3", "response-20", "output-3"],
)
def test_the_cap_keys_reach_the_rollout(overrides, reason, calls, turns):
    from grpo_fast.rollout import BackendContext, make_backend

    tok = _tok()
    cfg = _cfg(*overrides)
    backend = make_backend(BackendContext(cfg, ToolUser(tok, "loop"), tok, torch.device("cpu")))
    [t] = backend.generate([tok("12*34=")["input_ids"]], SamplingParams(1, 1.0, 1.0, 60, 0)).trajectories
    assert (t.finish_reason, len(t.tool_calls), t.num_turns) == (reason, calls, turns)
    cap = cfg.rollout.max_tool_output_tokens
    assert all(c.inserted <= cap and c.truncated == (cap < 5) for c in t.tool_calls)
    assert [c.inserted > 0 for c in t.tool_calls] == [k < t.num_turns - 1 for k in range(calls)]


def test_the_tool_setting_keys_reach_the_sandbox():
    """rollout.tool_timeout_s stops a call at that wall clock; rollout.tool_isolation=unsafe runs
    it without namespaces (the host's /etc is there); rollout.tool_workers bounds the calls at once."""
    from grpo_fast.rollout.multi_turn import from_config

    tok = _tok()
    code = lambda text: (None, ToolCall(text, None))
    limit = OutputLimit()
    slow = from_config(_cfg("rollout.environment=python", "rollout.tool_timeout_s=1"), tok).env
    [r] = slow.execute([(slow.new_state(), ToolCall("import time\ntime.sleep(30)\n", None))], limit)
    assert r.status == "timeout" and 1 <= r.seconds < 10 and "[timed out after 1 s]" in r.text
    for isolation, seen in (("bwrap", "False"), ("unsafe", "True")):
        env = from_config(_cfg("rollout.environment=python", f"rollout.tool_isolation={isolation}"), tok).env
        [r] = env.execute([(env.new_state(), code("import os\nprint(os.path.isdir('/etc'))\n")[1])], limit)
        assert r.text.strip().splitlines()[1] == seen, (isolation, r.text)
    spans = "import time\nt = time.time()\ntime.sleep(1.5)\nprint(t, time.time())\n"
    for workers, overlap in ((1, False), (2, True)):
        env = from_config(_cfg("rollout.environment=python", f"rollout.tool_workers={workers}"), tok).env
        results = env.execute([(env.new_state(), ToolCall(spans, None)) for _ in range(2)], limit)
        (a0, a1), (b0, b1) = (map(float, r.text.strip().splitlines()[1].split()) for r in results)
        assert (max(a0, b0) < min(a1, b1)) == overlap, (workers, results)


def test_math_tir_prompt_python_environment_and_boxed_reward_fit_together():
    """The ``math_tir`` format end to end on text: the prompt shows the fences the ``python``
    environment stops at and parses; its output block closes the turn; the ``boxed`` reward reads
    the model's last box outside the code and output blocks (a box the code printed is not an
    answer)."""
    from grpo_fast.env.registry import environment
    from grpo_fast.task.prompts import format_prompt, stop_strings
    from grpo_fast.task.rewards import boxed_reward_fn

    prompt = format_prompt("math_tir", "What is 6 times 7?")
    assert prompt.endswith("Problem: What is 6 times 7?\n\nSolution:") and "```output" in prompt
    assert stop_strings("math_tir") == ["\n\nProblem:"]
    env = environment("python").build(isolation="unsafe")
    turn = " Let me compute it.\n```python\nprint(f'\\\\boxed{{{6 * 7}}}')\n```\n```output"
    call = env.parse(turn)
    assert call.request == "print(f'\\\\boxed{{{6 * 7}}}')\n" and call.stop == "```output"
    [result] = env.execute([(env.new_state(), call)], OutputLimit(max_chars=200))
    assert result.ok and result.text == "\n\\boxed{42}\n```\n"
    printed_only = turn + result.text
    assert boxed_reward_fn(printed_only, "42") == {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}
    answered = printed_only + "The product is \\boxed{42}."
    assert boxed_reward_fn(answered, "42") == {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
    assert boxed_reward_fn(answered, "41")["answer_reward"] == 0.0


def test_every_engine_placement_takes_one_sampling_params_per_request():
    """``vllm.placement.shared.request_params``, what the colocated, process and server engines build their
    requests from: one ``SamplingParams`` for all prompts (prompt j seeded seed + j·n), or one per
    prompt with its own budget and seed (a multi-turn rollout's continuations)."""
    from dataclasses import replace

    from grpo_fast.rollout.vllm.placement.shared import request_params, sampling_fields

    one = SamplingParams(4, 1.0, 1.0, 20, 0, seed=100)
    assert [(p, s) for p, s in request_params(one, 3)] == [(one, 100), (one, 104), (one, 108)]
    each = [replace(one, n=1, max_tokens=k, seed=7 + k) for k in (3, 5)]
    fields = [sampling_fields(p, s) for p, s in request_params(each, 2)]
    assert [(f["n"], f["max_tokens"], f["seed"]) for f in fields] == [(1, 3, 10), (1, 5, 12)]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        request_params(each, 3)
