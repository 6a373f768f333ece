"""The vLLM backend's orchestration, on CPU, against a FAKE engine at the ``Engine`` boundary.

``FakeVLLMEngine`` is not vLLM: it is a clearly labelled stand-in with the same five methods as
``grpo_fast.rollout.vllm.VLLMEngine`` (generate / load_weights / wake_up / reset_prefix_cache /
sleep). It keeps its own copy of the weights (filled only through ``load_weights``, by Hugging
Face names, like vLLM), refuses to generate while asleep or with stale weights, and samples with
transformers. What runs for real with vLLM is in the ``gpu`` test at the end.
"""

import copy
import importlib.util
import math

import pytest
import torch

from grpo_fast import tiny
from grpo_fast.config import load_config
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.rollout.vllm import VLLMBackend


class FakeVLLMEngine:
    """FAKE vLLM engine for CPU tests (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer):
        self.model = copy.deepcopy(model).eval()
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))  # nothing valid until weights are pushed
        self.tokenizer = tokenizer
        self.awake = {"weights": True, "kv_cache": True}
        self.calls: list[str] = []
        self.pushed_versions = 0

    def load_weights(self, named_tensors):
        assert self.awake["weights"], "load_weights while the weights are asleep"
        own = self.model.state_dict()
        for name, t in named_tensors:
            own[name].copy_(t.to(own[name].dtype))
        self.pushed_versions += 1
        self.calls.append("load_weights")

    def wake_up(self, tags):
        for t in tags:
            self.awake[t] = True
        self.calls.append(f"wake_up({','.join(tags)})")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.awake = {"weights": False, "kv_cache": False}
        self.calls.append(f"sleep({level})")

    def generate(self, prompt_ids, params: SamplingParams):
        assert all(self.awake.values()), f"generate while asleep: {self.awake}"
        assert all(torch.isfinite(p).all() for p in self.model.parameters()), (
            "generate before any weight push"
        )
        self.calls.append("generate")
        rollout = HFBackend(self.model, self.tokenizer, generation_batch_size=256).generate(
            prompt_ids, params
        )
        groups, k = [], 0
        for p in prompt_ids:
            group = []
            for _ in range(params.n):
                ids = rollout.response_ids[k]
                group.append(
                    {
                        "token_ids": ids,
                        "text": rollout.response_text[k],
                        "finish_reason": rollout.finish_reason[k],
                        "logprobs": self._logprobs(p, ids, params.temperature),
                    }
                )
                k += 1
            groups.append(group)
        return groups

    @torch.no_grad()
    def _logprobs(self, prompt, ids, temperature):
        seq = torch.tensor([list(prompt) + list(ids)])
        logits = self.model(seq).logits[0, len(prompt) - 1 : -1].double() / max(temperature, 1e-6)
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def test_orchestration_order_and_weight_push():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    engine = FakeVLLMEngine(model, tok)
    backend = VLLMBackend(engine, tok, sleep_level=1)
    backend.update_weights(model)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=3, min_tokens=0)
    prompts = [tok("12+34=")["input_ids"], tok("5+5=")["input_ids"]]
    out = backend.generate(prompts, params)
    backend.sleep()
    assert engine.calls == ["load_weights", "reset_prefix_cache", "generate", "sleep(1)"]
    assert len(out.response_ids) == 4 and out.sampler_logprobs is not None
    assert [len(x) for x in out.sampler_logprobs] == [len(x) for x in out.response_ids]

    with torch.no_grad():  # the trainer takes a step...
        for p in model.parameters():
            p.add_(0.01)
    backend.update_weights(model)
    engine.calls.clear()
    backend.generate(prompts, params)
    # ...and the next rollout wakes the weights, pushes them, resets the prefix cache, then wakes the KV cache
    assert engine.calls == [
        "wake_up(weights)",
        "load_weights",
        "reset_prefix_cache",
        "wake_up(kv_cache)",
        "generate",
    ]
    for (name, a), b in zip(model.state_dict().items(), engine.model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_level_two_sleep_without_a_push_is_an_error():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    backend = VLLMBackend(FakeVLLMEngine(model, tok), tok, sleep_level=2)
    backend.update_weights(model)
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=2, min_tokens=0)
    backend.generate([[3, 4]], params)
    backend.sleep()
    with pytest.raises(RuntimeError, match="level 2"):
        backend.generate([[3, 4]], params)


@pytest.mark.slow
def test_training_loop_with_the_fake_engine_and_mismatch_correction(tmp_path):
    """The whole loop on the vllm backend (fake engine): weights are pushed every step and the
    sampler/trainer log-prob gap is ≈ 0 because both hold the same fp32 weights."""
    from grpo_fast.train import run

    cfg = load_config(
        "tiny",
        overrides=[
            f"output_dir={tmp_path}",
            "steps=3",
            "sft.steps=20",
            "eval_every=0",
            "checkpoint_every=0",
            "rollout.backend=vllm",
            "rollout.is_correction=true",
            "rollout.batch_size=32",
        ],
        check_device=False,
    )
    tok = tiny.build_tokenizer()
    engine = FakeVLLMEngine(tiny.build_model(tok, seed=0), tok)
    run(cfg, engine=engine)
    assert engine.pushed_versions == 3  # one push before each of the 3 rollouts
    import json

    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["rollout/logprob_abs_diff"] for r in rows if "rollout/logprob_abs_diff" in r]
    assert len(diffs) == 3 and max(diffs) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_real_vllm_engine_push_changes_outputs(tmp_path):
    """Real vLLM: after pushing perturbed weights, log-probs of the same tokens change; after
    pushing the original weights back, they return (the push reaches the engine's model)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_fast.rollout.vllm import VLLMEngine

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained("Qwen/Qwen2.5-0.5B").save_pretrained(tmp_path / "m")
    except OSError:
        pytest.skip("no Qwen tokenizer available offline")
    engine = VLLMEngine(str(tmp_path / "m"), gpu_memory_utilization=0.3, max_model_len=256, seed=0)
    backend = VLLMBackend(engine, None, sleep_level=1)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=8, min_tokens=8)
    first = backend.generate([[1, 2, 3]], params)
    backend.sleep()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    backend.update_weights(model.cuda())
    second = backend.generate([[1, 2, 3]], params)
    assert backend.calls[-5:] == [
        "wake_up(weights)",
        "load_weights",
        "reset_prefix_cache",
        "wake_up(kv_cache)",
        "generate",
    ]
    assert not math.isclose(sum(map(sum, first.sampler_logprobs)), sum(map(sum, second.sampler_logprobs)))
