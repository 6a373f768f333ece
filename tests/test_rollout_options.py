"""The rollout-side options in the loop's rollout phase (``grpo_fast.loop.rollout_phase``), on a
scripted backend whose responses are fixed per prompt, so every choice is hand-worked: DAPO
dynamic sampling (which groups are dropped, how many rounds), the overlong penalty, weighted
rewards, group sizes by pass rate, the difficulty filter and the curriculum, KL in the reward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.stand_ins import rollout_phase_run

from grpo_fast import dist
from grpo_fast import train as train_mod
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.loop import optimization
from grpo_fast.loop import rollout_phase as phase
from grpo_fast.loop.stats import StepStats
from grpo_fast.rollout import Rollout
from grpo_fast.rollout.sampling import step_seed
from grpo_fast.task.data import Example
from grpo_fast.task.rewards import GuardedReward, WeightedReward


class ScriptedBackend:
    """Prompt ``[p]``'s k-th response is ``script[p][k % len(script[p])]``: its text, and that many
    tokens as its length when the text is a number of tokens (``"x" * L``)."""

    def __init__(self, script: dict[int, list[str]]):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, params, progress=None):
        self.calls.append(([p[0] for p in prompt_ids], params.n, params.seed))
        texts = [self.script[p[0]][k % len(self.script[p[0]])] for p in prompt_ids for k in range(params.n)]
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=[[7] * max(len(t), 1) for t in texts],
            response_text=texts,
            finish_reason=["stop"] * len(texts),
        )

    def sleep(self):
        pass


class Events:
    def __init__(self):
        self.lines = []

    def event(self, line):
        self.lines.append(line)


class _Progress:
    def phase(self, *a):
        pass

    def advance_phase(self, *a):
        pass


def exact(response: str, ground_truth: str) -> dict[str, float]:
    ok = float(response == ground_truth)
    return {"reward": ok, "answer_reward": ok, "format_reward": 1.0}


def length(response: str, ground_truth: str) -> dict[str, float]:
    return {"reward": len(response) / 10}


def _run(script, *overrides, n_prompts=6, answers=None, difficulty=None, reward=None):
    """A ``Run`` holding just what the rollout phase reads; prompt ``p`` is token ``[p]``."""
    cfg = load_config("tiny", overrides=["rollout.group_size=2", "rollout.batch_size=4", *overrides])
    answers = answers or ["a"] * n_prompts
    train = [
        Example(f"q{p}", answers[p], difficulty=None if difficulty is None else difficulty[p])
        for p in range(n_prompts)
    ]
    task = SimpleNamespace(
        train=train,
        prompt_ids=lambda ex: [int(ex.question[1:])],
        reward_fn=reward or GuardedReward(exact, "exact"),
        stop=[],
    )
    run = rollout_phase_run(cfg, task, ScriptedBackend(script), logger=Events(), beta=cfg.loss.beta)
    run.backend = run.rollout.backend  # the tests read the scripted backend's calls
    return run


def _order(seed: int, n: int, k: int) -> list[int]:
    """The plain sampler's first ``k`` prompts (its seeded shuffle; tested in test_core)."""
    from grpo_fast.algo.prompt_sampler import PromptSampler

    return PromptSampler(n, seed).next(k)


MIXED, WRONG, RIGHT = ["a", "b"], ["b"], ["a"]  # a group of 2: rewards [1, 0], [0, 0], [1, 1]


def test_without_options_one_round_every_group_kept():
    script = {p: (MIXED if p % 2 else WRONG) for p in range(6)}
    run = _run(script)
    batch = phase.rollout_phase(run, 1, _Progress())
    assert len(run.backend.calls) == 1
    assert [int(e.question[1:]) for e in batch.examples] == _order(0, 6, 2)
    assert batch.extra == {}


def test_dynamic_sampling_drops_equal_reward_groups_and_draws_again():
    """Prompts 1, 3, 5 have mixed rewards, the others all-equal ones. Each round draws 2 prompts
    in the sampler's order; the step keeps the first 2 informative ones it meets."""
    script = {p: (MIXED if p % 2 else (RIGHT if p == 0 else WRONG)) for p in range(6)}
    run = _run(script, "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3")
    batch = phase.rollout_phase(run, 1, _Progress())
    order = _order(0, 6, 6)
    informative = [p for p in order if p % 2]
    # rounds needed: the round (2 prompts each) in which the 2nd informative prompt is drawn
    rounds = order.index(informative[1]) // 2 + 1
    drawn = order[: 2 * rounds]
    assert [c[0] for c in run.backend.calls] == [drawn[i : i + 2] for i in range(0, len(drawn), 2)]
    assert [int(e.question[1:]) for e in batch.examples] == informative[:2]
    assert batch.raw_rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.advantages.abs().min().item() > 0  # no zero-advantage response is left
    dropped = sum(1 for p in drawn if p % 2 == 0)
    assert batch.extra["rollout/sampling_rounds"] == rounds
    assert batch.extra["rollout/dropped_group_fraction"] == pytest.approx(dropped / len(drawn))
    assert batch.extra["rollout/informative_fraction_of_batch"] == 1.0
    assert run.logger.lines == []
    # each round has its own sampling seed; the first is the one the step always had
    seeds = [c[2] for c in run.backend.calls]
    assert len(set(seeds)) == len(seeds) and seeds[0] == step_seed(0, 1, 0)


def test_dynamic_sampling_gives_up_after_max_rounds_and_says_so():
    """Only prompt 5 is informative; 2 rounds of 2 prompts: it trains on what it found (if it
    met prompt 5) or on the last round (nothing informative at all), and logs one line."""
    script = {p: (MIXED if p == 5 else WRONG) for p in range(6)}
    run = _run(script, "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2")
    batch = phase.rollout_phase(run, 1, _Progress())
    drawn = _order(0, 6, 4)
    assert len(run.backend.calls) == 2
    kept = [int(e.question[1:]) for e in batch.examples]
    assert kept == ([5] if 5 in drawn else drawn[2:])
    assert batch.extra["rollout/informative_fraction_of_batch"] == (0.5 if 5 in drawn else 0.0)
    assert len(run.logger.lines) == 1 and "after 2 rounds" in run.logger.lines[0]
    assert "max_sampling_rounds=2" in run.logger.lines[0]


def test_overlong_penalty_is_added_to_the_rewards_before_the_advantage():
    """max_tokens 8, buffer 4, penalty 0.5: lengths 3, 5, 6, 8 → 0, −0.125, −0.25, −0.5 (the
    task reward is 0: no response is the answer "a")."""
    script = {p: ["xxx", "xxxxx"] if p % 2 else ["xxxxxx", "xxxxxxxx"] for p in range(4)}
    run = _run(
        script, "rollout.max_tokens=8", "data.overlong_buffer=4", "data.overlong_penalty=0.5", n_prompts=4
    )
    batch = phase.rollout_phase(run, 1, _Progress())
    penalty = {3: 0.0, 5: -0.125, 6: -0.25, 8: -0.5}
    assert batch.raw_rewards.tolist() == [penalty[len(t)] for t in batch.rollout.response_text]
    assert batch.extra["rollout/overlong_penalty_mean"] == pytest.approx(batch.raw_rewards.mean().item())
    # A = (r − mean) / (std + eps) within each group of 2: ±0.7071 whatever the gap
    assert batch.advantages.abs().tolist() == pytest.approx([0.5**0.5] * 4, rel=1e-4)


def test_weighted_rewards_sum_into_the_reward_and_each_part_is_reported():
    """reward = 1·exact − 0.5·length/10: "a" (right, 1 char) → 1 − .05 = .95; "bb" → −.1."""
    reward = WeightedReward([GuardedReward(exact, "exact"), GuardedReward(length, "length")], [1.0, -0.5])
    run = _run({p: ["a", "bb"] for p in range(6)}, reward=reward)
    batch = phase.rollout_phase(run, 1, _Progress())
    assert batch.raw_rewards.tolist() == pytest.approx([0.95, -0.1, 0.95, -0.1])
    assert batch.reward_meta["reward/exact_mean"] == pytest.approx(0.5)
    assert batch.reward_meta["reward/length_mean"] == pytest.approx(0.15)
    stats = StepStats()
    totals = stats.global_totals(
        dist.DistInfo(), torch.device("cpu"), batch.raw_rewards, batch.rollout, batch.reward_meta,
        reward_parts=["exact", "length"],  # Task.reward_parts of this WeightedReward
    )  # fmt: skip
    assert totals["reward_parts"] == pytest.approx({"train/reward/exact": 0.5, "train/reward/length": 0.15})
    assert totals["accuracy"] == pytest.approx(0.5)


def test_adaptive_group_size_follows_the_pass_rates_and_keeps_the_total():
    """group 4 in [2, 8], 2 prompts (8 responses) per step. Step 1: both unseen → 4 each. Then
    prompt 0 (always right, rate 1) and prompt 1 (always wrong, rate 0) target 2 and 8 (Σ 10);
    one shift λ = −2 for both gives [2 (held at the minimum), 6] (Σ 8)."""
    script = {p: (RIGHT if p % 2 == 0 else WRONG) for p in range(2)}
    run = _run(
        script,
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "rollout.adaptive_group_size=true",
        "rollout.min_group_size=2",
        "rollout.max_group_size=8",
        n_prompts=2,
    )
    first = phase.rollout_phase(run, 1, _Progress())
    assert first.rollout.sizes == [4, 4]
    assert [run.rollout.pass_rates.pass_rate(p) for p in (0, 1)] == [1.0, 0.0]
    second = phase.rollout_phase(run, 2, _Progress())
    by_prompt = {int(e.question[1:]): n for e, n in zip(second.examples, second.rollout.sizes)}
    assert by_prompt == {0: 2, 1: 6}
    assert sum(second.rollout.sizes) == 8 and len(second.raw_rewards) == 8
    # one generate call per distinct size, each with its own seed
    calls = run.backend.calls[1:]
    assert sorted(n for _, n, _ in calls) == [2, 6] and len({s for *_, s in calls}) == 2
    assert second.extra["rollout/group_size_min"] == 2 and second.extra["rollout/group_size_max"] == 6


def test_difficulty_filter_skips_solved_prompts_after_their_first_visit():
    """band [0, 0.9]: prompts 0 and 1 are always solved (rate 1 > 0.9). The first pass over the
    4 prompts sees every one; the second leaves 0 and 1 out."""
    script = {0: RIGHT, 1: RIGHT, 2: MIXED, 3: WRONG}
    run = _run(script, "rollout.difficulty_filter=[0.0,0.9]", n_prompts=4)
    seen = []
    for step in (1, 2, 3, 4):
        seen.append(sorted(int(e.question[1:]) for e in phase.rollout_phase(run, step, _Progress()).examples))
    assert sorted(seen[0] + seen[1]) == [0, 1, 2, 3]
    assert seen[2] == seen[3] == [2, 3]


def test_curriculum_easy_first_by_difficulty_field():
    """data.difficulty_field set: each pass goes from the lowest difficulty to the highest."""
    run = _run(
        {p: MIXED for p in range(4)},
        "rollout.curriculum=easy_first",
        "data.difficulty_field=level",
        n_prompts=4,
        difficulty=[3.0, 1.0, 4.0, 2.0],
    )
    got = [
        int(e.question[1:]) for step in (1, 2) for e in phase.rollout_phase(run, step, _Progress()).examples
    ]
    assert got == [1, 3, 0, 2]


def _tiny_models(seed_ref: int = 0, seed_policy: int = 1):
    from grpo_fast.task import tiny

    tok = tiny.build_tokenizer()
    return tok, tiny.build_model(tok, seed=seed_policy).eval(), tiny.build_model(tok, seed=seed_ref).eval()


def _eager_logprobs(model, prompt, response, temperature):
    """``[S]`` log π(response_t | prompt, response_<t) at ``temperature`` from the full logits, in float64."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature  # [L, V]
    logp = logits.log_softmax(-1)[len(prompt) - 1 : -1]  # the positions predicting the response
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]


def _eager_logprob_sum(model, prompt, response, temperature):
    """Σ log π(response | prompt) at ``temperature`` from the full logits, in float64."""
    return _eager_logprobs(model, prompt, response, temperature).sum().item()


@pytest.mark.parametrize("packing", [False, True])
def test_kl_in_reward_sums_k1_per_response_whatever_the_microbatch_order(packing):
    """Σ_t (log π − log π_ref) of each response, from the fused op's no-grad passes over
    microbatches of 2 (sorted by length, or packed), equals the float64 value from full logits
    for that same response: the sums land on the right response."""
    from grpo_fast.policy.loss import PolicyLoss

    tok, policy, ref = _tiny_models()
    cfg = load_config("tiny", overrides=["train.micro_batch_size=2", f"train.packing={str(packing).lower()}"])
    prompts = [[5, 6, 7], [8, 9]]  # the tiny vocabulary has 15 tokens
    responses = [[10, 11], [12, 13, 14, 3, 4], [2], [6, 7, 8]]  # prompt 0: 2, prompt 1: 2
    rollout = Rollout(prompts, responses, ["x"] * 4, ["stop"] * 4)
    run = SimpleNamespace(
        cfg=cfg,
        device=torch.device("cpu"),
        tokenizer=tok,
        trainer=SimpleNamespace(
            policy_loss=PolicyLoss(policy, autocast=None, backend="torch_chunked"),
            ref_loss=PolicyLoss(ref, autocast=None, backend="torch_chunked"),
            scoring_options=LossOptions,
        ),
    )
    sums, (total, tokens) = phase.response_kl_k1(run, rollout, temperature=0.7)
    per_token = phase.score_responses(run, rollout, 0.7, kl=True).kl_tokens
    expected = [
        _eager_logprob_sum(policy, p, r, 0.7) - _eager_logprob_sum(ref, p, r, 0.7)
        for p, r in zip(rollout.response_prompt_ids(), responses)
    ]
    assert sums.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert len(set(round(x, 3) for x in expected)) == 4  # distinct values: a swap would show
    assert tokens == 11 and total == pytest.approx(sum(expected), rel=1e-4, abs=1e-5)
    for k, p, r in zip(per_token, rollout.response_prompt_ids(), responses):  # each response's k1_t, in order
        eager = _eager_logprobs(policy, p, r, 0.7) - _eager_logprobs(ref, p, r, 0.7)
        assert k.tolist() == pytest.approx(eager.tolist(), rel=1e-4, abs=1e-5)


def test_kl_in_reward_lowers_each_reward_by_beta_times_its_k1_sum(monkeypatch):
    """loss.kl_in_reward with β 0.1: the rewards the advantages use are r − 0.1·Σk1 (the sums
    here are fixed: 2, −1, 0.5, 4)."""
    fixed = torch.tensor([2.0, -1.0, 0.5, 4.0])
    monkeypatch.setattr(phase, "response_kl_k1", lambda run, rollout, t: (fixed, (5.5, 8.0)))
    run = _run({p: MIXED for p in range(6)}, "loss.beta=0.1", "loss.kl_in_reward=true")
    batch = phase.rollout_phase(run, 1, _Progress())
    assert batch.raw_rewards.tolist() == pytest.approx([1 - 0.2, 0 + 0.1, 1 - 0.05, 0 - 0.4])
    assert batch.reward_meta["kl_reward_sum"] == 5.5 and batch.reward_meta["kl_reward_tokens"] == 8.0
    totals = StepStats().global_totals(
        dist.DistInfo(), torch.device("cpu"), batch.raw_rewards, batch.rollout, batch.reward_meta
    )
    assert totals["kl"] == pytest.approx(5.5 / 8)  # train/kl: k1 per sampled token


def test_kl_in_reward_needs_a_beta():
    from grpo_fast.errors import ConfigError

    with pytest.raises(ConfigError, match=r"loss.kl_in_reward=true needs loss.beta > 0"):
        load_config("tiny", overrides=["loss.kl_in_reward=true"])


ALL_OPTIONS = [
    "rollout.dynamic_sampling=true",
    "rollout.max_sampling_rounds=2",
    "data.overlong_buffer=1",
    "data.reward=[tiny,gsm8k]",
    "data.reward_weights=[1.0,0.5]",
    "rollout.difficulty_filter=[0.0,0.95]",
    "rollout.curriculum=easy_first",
    "rollout.adaptive_group_size=true",
    "rollout.min_group_size=4",
    "rollout.max_group_size=12",
    "sft.mix_coef=0.1",
    "loss.beta=0.02",
    "loss.kl_in_reward=true",
]


@pytest.mark.slow
def test_every_rollout_option_at_once_trains_and_resumes_exactly(tmp_path):
    """The tiny preset with every option of this file on: each one's metrics are logged, and a
    run stopped after step 2 and resumed (pass-rate table, sampler order, RNG from the
    checkpoint) logs exactly the metrics of the straight run."""
    import json

    quick = ["sft.steps=10", "eval_every=0", "checkpoint_every=2", "rollout.batch_size=16", "logging.progress=false",
             "logging.sample_every=0", *ALL_OPTIONS]  # fmt: skip
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_mod.run(load_config("tiny", overrides=[*quick, "steps=3", f"output_dir={straight}"]))
    train_mod.run(load_config("tiny", overrides=[*quick, "steps=2", f"output_dir={split}"]))
    train_mod.run(load_config("tiny", overrides=[*quick, "steps=3", "resume=true", f"output_dir={split}"]))

    def rows(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        skip = ("time/", "throughput/", "memory/", "gpu/")
        return [
            {k: v for k, v in json.loads(x).items() if not k.startswith(skip)} for x in lines if x.strip()
        ]

    a, b = rows(straight), rows(split)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert a == b
    last = a[-1]
    for key in ("rollout/sampling_rounds", "rollout/dropped_group_fraction", "rollout/overlong_penalty_mean",
                "train/reward/tiny", "train/reward/gsm8k", "rollout/filtered_prompts", "rollout/pass_rate_mean",
                "rollout/group_size_min", "rollout/group_size_max", "train/sft_loss", "train/kl"):  # fmt: skip
        assert key in last, key
    assert last["rollout/prompts_seen_fraction"] > 0 and last["train/sft_loss"] > 0


def test_sft_mix_gradient_is_mix_coef_times_the_per_token_mean_nll_gradient():
    """sft.mix_coef=0.5: the supervised microbatches (2 rows each, 3 examples) give the gradient
    of 0.5 × the mean over all solution tokens (+ EOS) of −log p, computed here from full logits."""
    from grpo_fast.policy.loss import PolicyLoss
    from grpo_fast.task.loader import load_task

    tok, policy, _ = _tiny_models()
    policy.train()
    cfg = load_config("tiny", overrides=["sft.mix_coef=0.5", "train.micro_batch_size=2"])
    task = load_task(cfg)
    task.tokenizer = tok
    examples = [task.train[i] for i in (0, 1, 2)]
    run = SimpleNamespace(
        cfg=cfg, tokenizer=tok, task=task, device=torch.device("cpu"), world=dist.DistInfo()
    )
    mbs = optimization._sft_microbatches(run, examples)
    assert len(mbs) == 2
    loss = PolicyLoss(policy, autocast=None, backend="torch_chunked")
    for mb in mbs:
        loss(mb, LossOptions(), 1.0).loss.backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)

    nll, tokens = 0.0, 0
    for ex in examples:
        prompt = task.prompt_ids(ex)
        target = tok(task.solution_text(ex), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        logp = policy(torch.tensor([prompt + target])).logits[0].log_softmax(-1)[len(prompt) - 1 : -1]
        nll = nll - logp.gather(1, torch.tensor(target)[:, None]).sum()
        tokens += len(target)
    (0.5 * nll / tokens).backward()
    for n, p in policy.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-7), n


def test_solution_field_names_the_worked_solution_in_a_data_file(tmp_path):
    """data.solution_field: the tiny task read from a file takes each example's solution from
    that field (without it, the bare answer); sft.mix_coef trains on it."""
    from grpo_fast.task.loader import load_task

    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1+2=", "answer": "3", "worked": "1+2=3"}\n')  # the tokenizer's characters
    task = load_task(load_config("tiny", overrides=[f"data.train_path={path}", "data.solution_field=worked"]))
    assert task.train[0].solution == "1+2=3"
    assert load_task(load_config("tiny", overrides=[f"data.train_path={path}"])).train[0].solution == "3"
