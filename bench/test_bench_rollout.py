"""Rollout throughput of the two backends on the same tiny work, on CPU: transformers ``generate``
(``hf``) against the real vLLM engine (``vllm``, in-process, fp32, as ``rollout.backend=vllm``
runs it, with the tiny preset's ``rollout.vllm_kwargs``).

The work: the tiny preset's model (random init, seed 0), 32 prompts of the tiny task × 8 samples
each, exactly 16 generated tokens per sample (``min_tokens = max_tokens``, so both backends
generate the same number of tokens), temperature 1. ``tokens_per_s`` counts generated tokens.
The ``vllm`` case needs vLLM (``make setup-vllm``; run this file with that environment's python
to have both rows in one JSON).
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.task import tiny

PROMPTS, GROUP, TOKENS, ROUNDS = 32, 8, 16, 5


def _work():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    prompts = [tok(e.question)["input_ids"] for e in tiny.examples("eval")[:PROMPTS]]
    params = SamplingParams(n=GROUP, temperature=1.0, top_p=1.0, max_tokens=TOKENS, min_tokens=TOKENS, seed=0)
    return tok, model, prompts, params


def _record(benchmark, impl: str, generated: int) -> None:
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        impl=impl,
        case=f"tiny model: {PROMPTS} prompts × {GROUP} samples × {TOKENS} tokens, fp32",
        tokens=generated,
        tokens_per_s=generated / median,
        load_average_1m=os.getloadavg()[0],
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
        command=(
            ".venv-vllm/bin/python -m pytest bench/test_bench_rollout.py -p no:cacheprovider "
            "--benchmark-json bench/results/rollout-cpu-$(date -u +%F).json  # make setup-vllm first"
        ),
    )


def _bench(benchmark, backend, prompts, params, impl: str) -> None:
    out: list[int] = []
    backend.generate(prompts, params)  # warm-up
    benchmark.pedantic(
        lambda: out.append(backend.generate(prompts, params).num_response_tokens), rounds=ROUNDS
    )
    assert out[-1] == PROMPTS * GROUP * TOKENS  # both backends generate exactly the same count
    _record(benchmark, impl, out[-1])


@pytest.mark.benchmark(group="rollout-cpu")
def test_rollout_hf_cpu(benchmark):
    tok, model, prompts, params = _work()
    _bench(benchmark, HFBackend(model, tok, generation_batch_size=PROMPTS * GROUP), prompts, params, "hf")


@pytest.mark.vllm
@pytest.mark.benchmark(group="rollout-cpu")
def test_rollout_vllm_cpu(benchmark, tmp_path):
    import vllm

    from grpo_fast.rollout.vllm import VLLMBackend
    from grpo_fast.testing import tiny_vllm_engine

    tok, model, prompts, params = _work()
    engine = tiny_vllm_engine(model, tok, tmp_path)  # the tiny preset's rollout.vllm_kwargs
    backend = VLLMBackend(engine, tok)
    backend.update_weights(model)  # as the loop does before every rollout
    _bench(benchmark, backend, prompts, params, "vllm")
    benchmark.extra_info["versions"]["vllm"] = vllm.__version__
