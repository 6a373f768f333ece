"""Engine pieces: checkpoints, LR schedule, prompt sampler, memory planner, HF rollouts."""

import re

import pytest
import torch

from grpo_fast.algo.prompt_sampler import PromptSampler
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.loop.optim import build_optimizer, lr_factor
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.task import tiny
from grpo_fast.tools import plan

# ---------------------------------------------------------------------------- checkpoints


def test_checkpoint_is_atomic_loadable_and_pruned(tmp_path):
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step, model, tok, {"train_state": {"step": step}}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000020", "step_000030"]
    # a half-written checkpoint (killed mid-write) is ignored
    (tmp_path / "step_000040.tmp").mkdir()
    (tmp_path / "step_000050").mkdir()  # no trainer_state.pt: incomplete
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000030"
    assert ckpt.load_state(tmp_path / "step_000030")["train_state"]["step"] == 30
    # Hugging Face format: transformers loads it as it is
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "step_000030")
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "step_000030")("12+3=")["input_ids"]
        == tok("12+3=")["input_ids"]
    )
    other = tiny.build_model(tok, seed=1)
    ckpt.load_model_weights(other, tmp_path / "step_000030")
    torch.testing.assert_close(other.lm_head.weight, model.lm_head.weight)


def test_final_model_replacement_keeps_a_complete_copy(tmp_path):
    """Saving over an existing folder (the final model of an extended run) leaves exactly one
    folder holding the new weights and tokenizer, complete, and nothing of the old copy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = tiny.build_tokenizer()
    first, second = tiny.build_model(tok, seed=0), tiny.build_model(tok, seed=1)
    ckpt.save_pretrained_atomic(first, tok, tmp_path / "final")
    files = sorted(p.name for p in (tmp_path / "final").iterdir())
    ckpt.save_pretrained_atomic(second, tok, tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no .tmp, no .old left
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == files and "model.safetensors" in files
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for name, value in second.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name  # the second model's weights
    assert not torch.equal(loaded.lm_head.weight, first.lm_head.weight)
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "final")("12+3=")["input_ids"] == tok("12+3=")["input_ids"]
    )


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    a = (torch.rand(3), __import__("random").random())
    ckpt.set_rng_state(state)
    b = (torch.rand(3), __import__("random").random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


# ---------------------------------------------------------------------------- optimizer, schedule, sampler


def test_lr_schedule_hand_values():
    cfg = load_config(
        "tiny",
        overrides=["steps=100", "train.warmup_steps=10", "train.schedule=cosine", "train.min_lr_ratio=0.1"],
    )
    assert lr_factor(4, cfg) == pytest.approx(0.5)  # (4+1)/10
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    # halfway through the cosine: 0.1 + 0.9·(1 + cos(π/2))/2 = 0.55
    assert lr_factor(55, cfg) == pytest.approx(0.55)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    lin = load_config(
        "tiny",
        overrides=["steps=10", "train.schedule=linear", "train.warmup_steps=0", "train.min_lr_ratio=0"],
    )
    assert lr_factor(5, lin) == pytest.approx(0.5)


def test_adamw8bit_runs_on_cpu():
    cfg = load_config("tiny", overrides=["train.optimizer=adamw8bit"])
    p = torch.nn.Parameter(torch.randn(4096))
    opt = build_optimizer(cfg, [p])
    assert type(opt).__name__ == "AdamW8bit"
    before = p.detach().clone()
    p.square().sum().backward()
    opt.step()
    assert not torch.equal(before, p.detach())
    assert opt.state[p]["state1"].dtype == torch.uint8  # 1 byte per moment


def test_fused_adamw_is_torch_s_kernel_where_asked_and_steps_as_the_per_tensor_form():
    """``train.fused_optimizer=true``: torch's fused AdamW over CPU tensors, both parameter groups
    (the value head's too), 20 steps within 1e-7 of the per-tensor form (the same update, rounded
    per element); ``auto`` on a CPU: the per-tensor form (torch's default here); on a device
    without the kernel (meta) torch's default whatever is asked; with adamw8bit, refused in one
    line. A checkpoint keeps the form it was written with. Planted: ``fused=None`` → the first
    assertion; auto read as true → the second."""
    from grpo_fast.loop.optim import adamw

    cfg = load_config("tiny", overrides=["train.weight_decay=0.01", "train.fused_optimizer=true"])
    torch.manual_seed(0)
    init = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(t) * 1e-2 for t in init] for _ in range(20)]

    def trained(make):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make(params)
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()
        return opt, params

    opt, fused = trained(lambda ps: build_optimizer(cfg, ps[:1], ps[1:]))
    assert [g["fused"] for g in opt.param_groups] == [True, True]
    auto = build_optimizer(load_config("tiny"), [torch.nn.Parameter(torch.zeros(3))])
    assert auto.param_groups[0]["fused"] is None and auto.param_groups[0]["foreach"] is None
    hyper = dict(lr=cfg.train.lr, betas=cfg.train.betas, weight_decay=cfg.train.weight_decay)
    _, ref = trained(lambda ps: torch.optim.AdamW(
        [{"params": ps[:1]}, {"params": ps[1:], "lr": cfg.train.lr, "weight_decay": 0.0}],
        foreach=False, **hyper))  # fmt: skip
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(fused, ref))
    assert not all(torch.equal(a, t) for a, t in zip(fused, init))
    meta = adamw([torch.nn.Parameter(torch.empty(3, device="meta"))], True, lr=1.0)
    assert meta.param_groups[0]["fused"] is None
    old, _ = trained(lambda ps: torch.optim.AdamW(ps, foreach=False, **hyper))
    again = adamw([torch.nn.Parameter(t.clone()) for t in init], True, **hyper)
    again.load_state_dict(old.state_dict())
    assert again.param_groups[0]["fused"] is None
    with pytest.raises(
        ConfigError, match=r"^train\.fused_optimizer=true is torch's fused AdamW; train\.optimizer=adamw8bit"
    ):
        load_config("tiny", overrides=["train.optimizer=adamw8bit", "train.fused_optimizer=true"])


def test_a_run_steps_with_the_fused_optimizer_it_is_asked_for(tmp_path):
    """End to end: the checkpoint of a one-step run holds the optimizer form ``train.fused_optimizer``
    asked for (auto on a CPU: per tensor). Planted: build_optimizer ignoring the key → both None."""
    from grpo_fast.train import main

    forms = {}
    for asked in ("auto", "true"):
        out = tmp_path / asked
        args = ["--preset", "tiny", "steps=1", "sft.steps=0", "eval_every=0", "checkpoint_every=1",
                "rollout.batch_size=16", "logging.progress=false", f"train.fused_optimizer={asked}", f"output_dir={out}"]  # fmt: skip
        assert main(args) == 0
        state = torch.load(next((out / "checkpoints").glob("step_*/trainer_state.pt")), weights_only=False)
        forms[asked] = state["optimizer"]["param_groups"][0]["fused"]
    assert forms == {"auto": None, "true": True}


def test_prompt_sampler_covers_each_pass_and_resumes_exactly():
    s = PromptSampler(10, seed=3)
    first = s.next(4) + s.next(6)
    assert sorted(first) == list(range(10))
    state = s.state_dict()
    ahead = s.next(7)
    t = PromptSampler(10, seed=3)
    t.load_state_dict(state)
    assert t.next(7) == ahead


# ---------------------------------------------------------------------------- memory planner


def test_plan_rtx4090_fits_24gb_and_counts_what_it_should():
    cfg = load_config("rtx4090", check_device=False, overrides=["train.micro_batch_size=auto"])
    arch = plan.arch_for(cfg)
    assert arch.num_params == pytest.approx(1.54e9, rel=0.01)  # Qwen2.5-1.5B: 1.54 B parameters
    p = plan.plan_memory(cfg, arch, 24e9)
    # fp32 master weights and gradients: 4 B/param each; 8-bit AdamW: 2 B/param
    assert p.weights == p.grads == arch.num_params * 4
    assert p.optimizer == arch.num_params * 2
    assert p.micro_batch_size >= 1 and p.train_peak <= 24e9
    assert 0.05 < p.gpu_memory_utilization < 0.9 and p.vllm_kv_tokens > 100_000
    # Qwen2.5-1.5B KV cache: 2 (K,V) · 28 layers · 2 KV heads · 128 · 2 B = 28,672 B/token
    assert p.vllm_kv_per_token == 28_672
    # without gradient checkpointing activations grow by ~the layer count
    no_ckpt = plan.plan_memory(
        load_config("rtx4090", check_device=False, overrides=["model.gradient_checkpointing=false"]),
        arch,
        24e9,
    )
    assert no_ckpt.activation_per_token > 10 * p.activation_per_token


def test_plan_refuses_what_cannot_fit():
    cfg = load_config(
        "rtx4090", check_device=False, overrides=["train.micro_batch_size=auto", "train.optimizer=adamw"]
    )
    with pytest.raises(ConfigError, match="no room for one 1536-token sequence on a 12 GB card"):
        plan.plan_memory(cfg, plan.arch_for(cfg), 12e9)


def test_plan_cli_prints_the_budget(capsys):
    assert plan.main(["--preset", "rtx4090", "--gpu-mem-gb", "24"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "weights",
        "optimizer state",
        "vLLM KV cache",
        "train.micro_batch_size",
        "rollout.gpu_memory_utilization",
    ):
        assert needle in out


# ---------------------------------------------------------------------------- HF rollouts


def test_hf_backend_groups_stop_and_eos():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    backend = HFBackend(model, tok, generation_batch_size=8)
    prompts = [tok("1+2=")["input_ids"], tok("33+44=")["input_ids"]]
    torch.manual_seed(0)
    out = backend.generate(
        prompts, SamplingParams(n=3, temperature=1.0, top_p=1.0, max_tokens=5, min_tokens=0)
    )
    assert len(out.response_ids) == 6 and out.group_size == 3
    for ids, reason in zip(out.response_ids, out.finish_reason):
        assert 1 <= len(ids) <= 5
        if tok.eos_token_id in ids:
            assert ids.index(tok.eos_token_id) == len(ids) - 1 and reason == "stop"
        else:
            assert len(ids) == 5 and reason == "length"
    assert model.training  # generate() restores the training mode
    greedy = backend.generate(
        prompts, SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=5, min_tokens=0)
    )
    again = backend.generate(
        prompts, SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=5, min_tokens=0)
    )
    assert greedy.response_ids == again.response_ids


def test_hf_backend_keeps_each_response_with_its_prompt():
    """Each response stays under the prompt it answers, through left padding, several calls (two
    prompts per call), the prefill shared by a prompt's samples and the cache steps: a policy that
    answers the prompt its cache holds (tests/answer_oracle.py: right on a group's even samples,
    ten times that on the odd ones) earns the tiny reward exactly on the even samples when every
    response is graded against its own prompt's answer."""
    import answer_oracle

    tok = tiny.build_tokenizer()
    backend = HFBackend(answer_oracle.AnswerModel(tok), tok, generation_batch_size=6)
    questions = ["12+34=", "5+7=", "60+21=", "9+9=", "33+44="]  # five different sums
    out = backend.generate(
        [tok(q)["input_ids"] for q in questions],
        SamplingParams(n=3, temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0),
    )
    answer_oracle.check_grouped(out, questions, 3, tok)
    assert set(out.finish_reason) == {"stop"}


def test_hf_backend_cuts_at_a_stop_string_and_keeps_it():
    tok = tiny.build_tokenizer()
    from grpo_fast.rollout.hf.decoder import _trim

    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=6, min_tokens=0, stop=("+",))
    ids = tok("12+3")["input_ids"] + [tok.pad_token_id] * 2
    kept, reason = _trim(ids, tok, params)
    assert tok.decode(kept) == "12+" and reason == "stop"


def test_tiny_model_matches_the_planner_count():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    n = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert plan.Arch.from_hf_config(model.config).num_params == n


def test_policy_is_loaded_in_train_mode_with_checkpointing_active():
    """transformers checkpoints only in training mode, and from_pretrained returns eval mode."""
    from grpo_fast.policy.model import load_policy

    cfg = load_config("tiny", overrides=["model.gradient_checkpointing=true"])
    tok = tiny.build_tokenizer()
    model = load_policy(cfg, tok, torch.device("cpu"))
    assert model.training
    # checkpointed layers keep far less for the backward: compare saved tensors with and without
    ids = torch.randint(3, 15, (4, 12))

    def saved_bytes(m):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(ids).logits.sum()
        return total

    plain = load_policy(load_config("tiny"), tok, torch.device("cpu"))
    assert saved_bytes(model) < 0.5 * saved_bytes(plain)


def test_reward_from_a_module_path_and_clear_errors(tmp_path, monkeypatch):
    from grpo_fast.task.loader import load_task

    (tmp_path / "my_rewards.py").write_text(
        "def exact(response, ground_truth):\n    return {'reward': float(response == ground_truth)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = tiny.build_tokenizer()
    task = load_task(load_config("tiny", overrides=["data.reward=my_rewards:exact"]), tok)
    assert task.reward_fn("46", "46") == {"reward": 1.0}
    with pytest.raises(ConfigError, match=re.escape("data.reward='my_rewards:nope': cannot import it")):
        load_task(load_config("tiny", overrides=["data.reward=my_rewards:nope"]), tok)
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        load_task(load_config("tiny", overrides=["data.reward=nope"]), tok)


def test_evaluate_cli_on_a_saved_checkpoint(tmp_path, capsys):
    import json

    from grpo_fast.tools import evaluate

    tok = tiny.build_tokenizer()
    ckpt.save_pretrained_atomic(tiny.build_model(tok, seed=0), tok, tmp_path / "m")
    out = tmp_path / "records.jsonl"
    assert (
        evaluate.main(
            ["--model", str(tmp_path / "m"), "--preset", "tiny", "--limit", "20", "--out", str(out)]
        )
        == 0
    )
    metrics = json.loads(capsys.readouterr().out)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == 20 and {"prompt", "response", "ground_truth", "reward", "length"} <= set(
        records[0]
    )
    # each record graded against its own problem, and the accuracy is their mean
    assert metrics["eval/num_examples"] == 20
    for r in records:
        assert r["ground_truth"] == str(sum(int(x) for x in r["prompt"].rstrip("=").split("+")))
        assert r["reward"] == tiny.tiny_reward_fn(r["response"], r["ground_truth"])["reward"]
    assert metrics["eval/accuracy"] == pytest.approx(sum(r["reward"] for r in records) / 20)
    assert evaluate.main(["--model", str(tmp_path / "missing"), "--preset", "tiny"]) == 2
