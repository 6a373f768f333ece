"""The built-in tiny task: a model, a tokenizer and a verifiable task that fit a 2-core CPU.

- Task: two-digit addition, ``"37+45="`` → ``"82"``. All 10,000 ordered pairs (a, b) with
  0 ≤ a, b ≤ 99, shuffled with a fixed seed; the first 500 are held out for evaluation.
- Tokenizer: one token per character (``0-9 + =``) plus ``<pad>``, ``<eos>``, ``<unk>``; a
  Hugging Face ``tokenizers`` WordLevel model, saved with every checkpoint. ``builtin:tiny_tools``
  adds ``*`` and the calculator's tags as whole tokens (``BUILTINS``; the task ``tiny_tools``).
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

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_fast.task.rewards import register_reward
from grpo_fast.task.spec import Example, TaskSpec

if TYPE_CHECKING:  # transformers is imported where a model or tokenizer is built (the task
    # registry imports this module with the config, which needs neither)
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

BUILTIN_NAME = "builtin:tiny"
TOOLS_NAME = "builtin:tiny_tools"  # the same model with the calculator's tags (task tiny_tools)
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARS = "0123456789+="
EVAL_SIZE = 500
TASK_SEED = 1234


@dataclass(frozen=True)
class Builtin:
    """A built-in tokenizer (and the model sized for it): one token per character of ``chars``,
    one per tag of ``tags`` (whole words: ``<calc>`` is one token), contexts of ``max_length``."""

    chars: str
    tags: tuple[str, ...] = ()
    max_length: int = 32


BUILTINS = {
    BUILTIN_NAME: Builtin(CHARS),
    # products with the calculator: "123*45=<calc>123*45</calc><result>5535</result>5535"
    TOOLS_NAME: Builtin(CHARS + "*", ("<calc>", "</calc>", "<result>", "</result>"), 64),
}


def vocabulary(name: str = BUILTIN_NAME) -> dict[str, int]:
    """The built-in tokenizer ``name``'s vocabulary: ids 0-2 special, then one id per character
    of its ``chars``, then one per tag."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for piece in (*BUILTINS[name].chars, *BUILTINS[name].tags):
        vocab[piece] = len(vocab)
    return vocab


def build_tokenizer(name: str = BUILTIN_NAME) -> PreTrainedTokenizerFast:
    """The built-in character-level tokenizer ``name`` (``vocabulary``); any other character
    becomes ``<unk>``. Its tags are whole tokens wherever they appear in a text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    spec = BUILTINS[name]
    tok = Tokenizer(WordLevel(vocab=vocabulary(name), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # "1", "2" → "12" (no spaces between characters)
    if spec.tags:  # matched before the split into characters; not special (decoded text keeps them)
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in spec.tags])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=spec.max_length,
    )


def build_model_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    """The tiny Qwen2 for a built-in tokenizer: its vocabulary, contexts of its
    ``model_max_length``."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialized tiny model (weights depend only on ``seed``)."""
    import torch
    from transformers import Qwen2ForCausalLM

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


def three_digit_sums() -> list[Example]:
    """A generalization test the training never shows (eval set ``tiny_3digit``): 500 sums of two
    three-digit numbers below 500, ``"123+456="`` → ``"579"``, drawn with a fixed seed; the same
    characters, so the built-in tokenizer reads them, and three-digit answers, so that the tiny
    preset's 4 new tokens (3 digits and the end) fit every answer."""
    rng = random.Random(TASK_SEED + 3)
    pairs = [(rng.randrange(100, 500), rng.randrange(100, 500)) for _ in range(EVAL_SIZE)]
    return [Example(question=f"{a}+{b}=", answer=str(a + b)) for a, b in pairs]


def has_builtin_tokenizer(name_or_path: str, builtin: str = BUILTIN_NAME) -> bool:
    """Whether the model ``name_or_path`` reads text with the built-in character tokenizer
    ``builtin``: that built-in model, or a folder a run of it wrote (its ``tokenizer.json``
    holds ``vocabulary(builtin)``)."""
    if name_or_path == builtin:
        return True
    try:
        saved = json.loads((Path(name_or_path).expanduser() / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return saved == vocabulary(builtin)


def alphabet(model_name: str) -> str | None:
    """The characters a data file's text may hold for ``model.name_or_path``: ``CHARS`` with the
    built-in tokenizer (anything else would become ``<unk>``), None (any) with another."""
    return CHARS if has_builtin_tokenizer(model_name) else None


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


def extract_bare_answer(value: str, field: str, named: bool) -> str:
    """A data file's answer is the value itself (``"82"``); a GSM8K-style ``"... #### 82"`` is read
    as ``82``; commas are dropped (``1,000`` → ``1000``)."""
    _, sep, tail = value.rpartition("####")
    return (tail if sep else value).strip().replace(",", "")


def extract_bare_solution(value: str, named: bool) -> str | None:
    """A named solution field's text (GSM8K-style: the text before ``####``)."""
    from grpo_fast.task.gsm8k import extract_solution

    return extract_solution(value, named)


TASK = TaskSpec(
    name="tiny",
    summary="two-digit addition with the built-in model and tokenizer (any CPU)",
    reward="tiny",
    question_fields=("question", "problem"),  # a data file's fields (data.train_path / eval_path)
    answer_fields=("answer", "solution"),
    extract_answer=extract_bare_answer,
    extract_solution=extract_bare_solution,
    builtin=examples,
    alphabet=alphabet,
    builtin_difficulty_field=DIFFICULTY_FIELD,
    solution_is_answer=True,  # the response the reward wants is the bare answer
)
