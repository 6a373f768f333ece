"""The built-in task that needs a tool: products of 2-3-digit numbers, with the calculator.

``"123*45="`` → the model writes ``<calc>123*45</calc>``, its turn stops there, the ``calculator``
environment inserts ``<result>5535</result>``, and the model copies ``5535``. The tiny built-in
model (``builtin:tiny_tools``: the tiny Qwen2 with ``*`` and the calculator's four tags as tokens,
contexts of 64) cannot multiply, but it can copy operands into a call and a result back out:
without the tool its answers are guesses, with it they can all be right. The first run a
newcomer makes of tool use (``--preset tiny_tools``).

- Problems: ``a*b`` with ``10 ≤ a, b ≤ 999`` (products of up to 6 digits), 20,500 distinct
  pairs drawn with a fixed seed; the first 500 are held out for evaluation.
- Demonstrations (each example's ``solution``: what the SFT warm start trains on, ``TaskSpec.
  warm_start``): the model's part of an answer. Most use the tool — ``<calc>a*b</calc>`` then the
  product: the warm start inserts the calculator's output between the two, as a rollout does
  (``grpo_fast.rollout.multi_turn.demonstrations``), so it is context there, never a target —
  and ``DIRECT_SHARE`` of them answer straight away, as a base model often does; the product
  written without the tool is what the model cannot compute. GRPO then has a choice to learn.
- Reward (``tiny_tools``): the answer is the text after the last tool output (after the last
  ``</result>``, or the whole response without one); ``answer_reward`` is 1 when it is the
  product, ``format_reward`` when it is digits only; ``reward = answer_reward``.
"""

from __future__ import annotations

import random

from grpo_fast.task import tiny
from grpo_fast.task.rewards import register_reward
from grpo_fast.task.spec import Example, TaskSpec

EVAL_SIZE = 500
TRAIN_SIZE = 20_000
TASK_SEED = 4321
DIRECT_SHARE = 0.5  # demonstrations that answer without the tool
LOW, HIGH = 10, 999  # the operands: 2-3 digits
RESULT_END = "</result>"


def examples(split: str) -> list[Example]:
    """``split="train"``: 20,000 problems; ``split="eval"``: the 500 held-out ones (no pair in
    both). The worked solution is a demonstration (module docstring); the difficulty is the
    product's number of digits (4-6)."""
    rng = random.Random(TASK_SEED)
    seen, pairs = set(), []
    while len(pairs) < EVAL_SIZE + TRAIN_SIZE:
        pair = (rng.randint(LOW, HIGH), rng.randint(LOW, HIGH))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    chosen = pairs[:EVAL_SIZE] if split == "eval" else pairs[EVAL_SIZE:]
    direct = random.Random(TASK_SEED + 1)
    out = []
    for a, b in chosen:
        product = str(a * b)
        demo = product if direct.random() < DIRECT_SHARE else f"<calc>{a}*{b}</calc>{product}"
        out.append(
            Example(question=f"{a}*{b}=", answer=product, solution=demo, difficulty=float(len(product)))
        )
    return out


def final_answer(response: str) -> str:
    """The answer of a response: the text after its last tool output, stripped.

    Example:
        >>> final_answer("<calc>12*34</calc><result>408</result>408"), final_answer(" 99 ")
        ('408', '99')
    """
    return response.rpartition(RESULT_END)[2].strip()


@register_reward("tiny_tools")
def tiny_tools_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """``{"format_reward": digits only, "answer_reward": the product, "reward"}`` of the answer
    after the last tool output (``final_answer``)."""
    answer = final_answer(response)
    fmt = float(answer.isdigit())
    ans = float(fmt == 1.0 and answer == ground_truth.strip())
    return {"format_reward": fmt, "answer_reward": ans, "reward": ans}


def alphabet(model_name: str) -> str | None:
    """The characters a data file's text may hold with ``builtin:tiny_tools``' tokenizer: its
    characters and those of its tags (a tag's character outside the tag would be ``<unk>``)."""
    if not tiny.has_builtin_tokenizer(model_name, tiny.TOOLS_NAME):
        return None
    spec = tiny.BUILTINS[tiny.TOOLS_NAME]
    return spec.chars + "".join(sorted(set("".join(spec.tags))))


TASK = TaskSpec(
    name="tiny_tools",
    summary="products of 2-3-digit numbers with the calculator tool and the built-in model (any CPU)",
    reward="tiny_tools",
    question_fields=("question", "problem"),
    answer_fields=("answer",),
    solution_field="solution",
    extract_answer=tiny.extract_bare_answer,
    builtin=examples,
    alphabet=alphabet,
    builtin_difficulty_field="digits",
    warm_start="solution",  # the demonstrations, tool calls and all
)
