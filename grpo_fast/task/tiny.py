"""The built-in tiny task: a model, a tokenizer and a verifiable task that fit a 2-core CPU.

- Task: two-digit addition, ``"37+45="`` → ``"82"``. All 10,000 ordered pairs (a, b) with
  0 ≤ a, b ≤ 99, shuffled with a fixed seed; the first 500 are held out for evaluation.
- Tokenizer: one token per character (``0-9 + =``) plus ``<pad>``, ``<eos>``, ``<unk>``; a
  Hugging Face ``tokenizers`` WordLevel model, saved with every checkpoint.
- Model: a Qwen2-architecture decoder (hidden 128, 3 layers, 4 heads / 2 KV heads, tied
  embeddings; ≈ 0.4 M parameters), random init from a seed.
- Reward: exact match of the digits (``answer_reward``), digits-only (``format_reward``).

Random weights learn nothing from GRPO here (a right answer has probability ≈ 1/15² per
sample, so nearly every group has zero reward variance: measured on single-digit addition, the
policy collapsed to a constant answer, eval accuracy 0.00-0.07 after 2,000 steps).
The tiny preset therefore starts with a short SFT warm start, like a real run starts from a
pretrained base model, and GRPO then sharpens it.
"""

from __future__ import annotations

import random

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from grpo_fast.task.data import Example
from grpo_fast.task.rewards import register_reward

BUILTIN_NAME = "builtin:tiny"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARS = "0123456789+="
EVAL_SIZE = 500
TASK_SEED = 1234


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0-2 special, then one id per character of ``CHARS``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # "1", "2" → "12" (no spaces between characters)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=32,
    )


def build_model_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialized tiny model (weights depend only on ``seed``)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(build_model_config(tokenizer))


def examples(split: str) -> list[Example]:
    """``split="train"``: 9,500 problems; ``split="eval"``: the 500 held-out ones."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(TASK_SEED).shuffle(pairs)
    chosen = pairs[:EVAL_SIZE] if split == "eval" else pairs[EVAL_SIZE:]
    # the worked solution (sft.mix_coef's target) is the answer itself: the reward wants digits only;
    # the difficulty (data.difficulty_field=carries) is the number of carries, 0-2
    return [
        Example(question=f"{a}+{b}=", answer=str(a + b), solution=str(a + b), difficulty=float(carries(a, b)))
        for a, b in chosen
    ]


DIFFICULTY_FIELD = "carries"


def carries(a: int, b: int) -> int:
    """Carries in the column addition of ``a + b`` (0 ≤ a, b ≤ 99): ``carries(37, 45) == 1``
    (7 + 5 = 12), ``carries(95, 17) == 2``, ``carries(12, 30) == 0``."""
    ones = (a % 10 + b % 10) >= 10
    return int(ones) + int((a // 10 + b // 10 + ones) >= 10)


@register_reward("tiny")
def tiny_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Exact match: ``{"format_reward": digits only, "answer_reward": == ground truth, "reward"}``."""
    text = response.strip()
    fmt = float(text.isdigit())
    ans = float(fmt == 1.0 and text == ground_truth.strip())
    return {"format_reward": fmt, "answer_reward": ans, "reward": ans}
