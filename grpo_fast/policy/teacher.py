"""The teacher of on-policy distillation (``distill.teacher``): a frozen causal LM whose per-token
log-probs of the student's own samples make a dense reward.

``load_teacher`` loads it forward-only (no gradients, eval mode) in the dtype the reference copy
uses (the autocast dtype when there is one: bf16 on a GPU, half the bytes of fp32), after
checking that its vocabulary is the student's token for token: the student's token ids must mean
the same to it. Its log-probs come from the same fused op as the policy's (``PolicyLoss`` over
the teacher: chunks of logits from its hidden states), so its ``[tokens × vocab]`` logits never
exist either. It is never pushed to a rollout engine.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from grpo_fast.errors import ConfigError
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.task import tiny

__all__ = ["check_teacher", "load_teacher"]


def load_teacher(
    source: str,
    student_tokenizer,
    student_vocab_size: int,
    dtype: torch.dtype,
    device,
    load_in_4bit: bool = False,
) -> nn.Module:
    """The frozen teacher at ``source`` (a model folder, a hub name, or a built-in model), on
    ``device`` in ``dtype`` (``load_in_4bit``: its linear layers in NF4, computing in ``dtype``).
    ``ConfigError`` in one line when it cannot be loaded, or its tokenizer or vocabulary differs
    from the student's (``student_tokenizer``, ``student_vocab_size``: the student's embedding
    rows)."""
    from transformers import AutoModelForCausalLM

    where = f"distill.teacher={source!r}"
    check_teacher(source, student_tokenizer)
    extra = {}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        extra = dict(quantization_config=quant, device_map={"": device})
    try:
        teacher = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot load the model ({str(exc).splitlines()[0]})") from None
    rows = teacher.get_output_embeddings().weight.shape[0]
    if rows != student_vocab_size:
        raise ConfigError(
            f"{where}: its vocabulary has {rows} rows, the student's {student_vocab_size}: the "
            "teacher must share the student's tokenizer and vocabulary"
        )
    teacher.config.use_cache = False
    if not load_in_4bit:  # bitsandbytes placed the 4-bit model already
        teacher.to(device)
    return teacher.eval().requires_grad_(False)


def check_teacher(source: str, student_tokenizer) -> None:
    """What can be checked without the teacher's weights (the run, and the dry run, before any
    model loads): not a built-in model, a folder that exists and is not damaged, the student's
    tokenizer. ``ConfigError`` / ``CheckpointError`` in one line."""
    where = f"distill.teacher={source!r}"
    if source in tiny.BUILTINS:
        raise ConfigError(f"{where}: a built-in model is random weights; give a trained model's folder")
    if source.startswith(("/", "./", "../", "~")) and not Path(source).expanduser().is_dir():
        raise ConfigError(f"{where}: no such folder")
    ckpt.check_model_folder(source, "re-save the teacher")
    _check_vocabulary(source, where, student_tokenizer)


def _check_vocabulary(source: str, where: str, student_tokenizer) -> None:
    """The teacher's tokenizer maps every token to the student's id."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot load its tokenizer ({str(exc).splitlines()[0]})") from None
    mine = student_tokenizer.get_vocab()
    other = theirs.get_vocab()
    if other != mine:
        differ = sorted(set(mine.items()) ^ set(other.items()), key=str)[:1]
        raise ConfigError(
            f"{where}: its tokenizer differs from the student's ({len(other)} tokens against "
            f"{len(mine)}; first difference {differ[0] if differ else '?'}): the teacher must share "
            "the student's tokenizer and vocabulary"
        )
