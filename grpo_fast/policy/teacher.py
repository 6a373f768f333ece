"""The teacher of on-policy distillation (``distill.teacher``): a frozen causal LM whose per-token
log-probs of the student's own samples make a dense reward.

``load_teacher`` loads it forward-only (no gradients, eval mode) in the dtype the reference copy
uses (the autocast dtype when there is one: bf16 on a GPU, half the bytes of fp32), after
checking that its vocabulary is the student's token for token: the student's token ids must mean
the same to it. Its log-probs come from the same fused op as the policy's (``PolicyLoss`` over
the teacher: chunks of logits from its hidden states), so its ``[tokens × vocab]`` logits never
exist either. It is never pushed to a rollout engine.

``distill.placement=server``: the teacher is a vLLM server instead (``served_teacher``: started by
the run from ``distill.teacher``, or the one at ``distill.server_url``), and ``ServedTeacher`` asks it
for each response's prompt log-probs (``POST /inference/v1/generate`` with ``prompt_logprobs: 0``
over the prompt and the response: the teacher's log-prob of each token given what precedes it,
at temperature 1 over the whole vocabulary). The trainer holds none of its weights; the requests
run in the server while the trainer computes the student's own log-probs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from grpo_fast.errors import ConfigError, EngineError
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.task import tiny

__all__ = ["ServedTeacher", "check_served", "check_teacher", "load_teacher", "served_teacher"]


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


class ServedTeacher:
    """The teacher's per-token log-probs from a vLLM server (``distill.placement=server``) over
    ``engine`` (a ``ServerEngine`` without weight transport). ``submit(trajectories)`` sends one
    request per trajectory at once and returns their futures; each gives ``[S]`` fp32, the
    teacher's log-probs of the trajectory's sampled tokens (inserted tool output is context, not
    asked), in order. ``close`` stops a server the run started."""

    def __init__(self, engine, where: str):
        self.engine, self.where = engine, where

    def submit(self, trajectories) -> list:
        return [self.engine.pool.submit(self.logprobs, t) for t in trajectories]

    def logprobs(self, trajectory) -> torch.Tensor:
        from grpo_fast.rollout.trajectory import Role

        prompt, response, roles = trajectory.prompt_ids, trajectory.token_ids, trajectory.roles
        per_position = self.engine.prompt_logprobs(
            [*prompt, *response], doing=f"the teacher's log-probs from {self.where}"
        )  # [P + T − 1]: position i is token i + 1's
        sampled = [
            len(prompt) + j - 1 for j in range(len(response)) if roles is None or roles[j] == Role.SAMPLED
        ]
        return torch.tensor([per_position[i] for i in sampled], dtype=torch.float32)

    def close(self) -> None:
        self.engine.close()


def served_teacher(cfg, student_tokenizer, out_dir: Path | None, dtype: torch.dtype) -> ServedTeacher:
    """``distill.placement=server``: the server at ``distill.server_url`` (waited for at most
    ``rollout.start_timeout``), or one the run starts from ``distill.teacher`` in ``dtype`` on
    ``distill.devices`` with ``rollout.vllm_kwargs`` (its log ``out_dir/vllm_teacher.log``). Checked
    before the first step, each a ``ConfigError`` in one line: the teacher's tokenizer is the
    student's (``check_teacher``), the server tokenizes as the student does, and its context holds
    the run's longest sequence (``rollout.max_prompt_tokens`` + the longest response)."""
    from grpo_fast.rollout import multi_turn
    from grpo_fast.rollout.vllm.deadline import Deadline, Timeouts
    from grpo_fast.rollout.vllm.placement.server import (
        ServerEngine,
        server_command,
        start_server,
        wait_listening,
    )
    from grpo_fast.rollout.vllm.transfer.transport import free_port

    d, r = cfg.distill, cfg.rollout
    check_teacher(d.teacher, student_tokenizer)
    timeouts = Timeouts(r.start_timeout, r.request_timeout, r.sync_timeout)
    longest = r.max_prompt_tokens + multi_turn.max_response_tokens(r)
    serving = str(dtype).removeprefix("torch.")
    process, url = None, d.server_url
    if url is None:
        port = free_port()
        command = server_command(d.teacher, port, dtype=serving, max_model_len=longest, seed=cfg.seed,
                                 extra_args=dict(r.vllm_kwargs), devices=d.devices,
                                 cpu=not torch.cuda.is_available())  # fmt: skip
        log = Path(out_dir or ".") / "vllm_teacher.log"
        process = start_server(command, port, log, timeouts, devices=d.devices)
        url = process.url
    else:
        url = url.rstrip("/")
        wait_listening(
            url, Deadline(r.start_timeout, f"the teacher's vLLM server at {url}", "rollout.start_timeout")
        )
    engine = ServerEngine(url, timeouts=timeouts, dtype=serving, process=process, follower=True)
    try:
        _check_server(engine, url, student_tokenizer, longest, timeouts)
    except BaseException:
        engine.close()
        raise
    return ServedTeacher(engine, f"the teacher's vLLM server at {url}")


def check_served(cfg, student_tokenizer) -> None:
    """The dry run's check of the teacher's server at ``distill.server_url``: ``served_teacher``'s
    checks of its context and tokenizer, each ``ConfigError`` as the run gives it. Skipped when it
    does not answer within 5 s (the run waits ``rollout.start_timeout`` for it)."""
    from grpo_fast.rollout import multi_turn
    from grpo_fast.rollout.vllm.deadline import Deadline, Timeouts
    from grpo_fast.rollout.vllm.placement.server import ServerEngine, wait_listening

    r = cfg.rollout
    url = cfg.distill.server_url.rstrip("/")
    try:
        wait_listening(url, Deadline(5.0, f"the teacher's vLLM server at {url}", "rollout.start_timeout"))
    except EngineError:
        return
    engine = ServerEngine(url, timeouts=Timeouts(r.start_timeout, 30.0, 30.0), dtype="float32", follower=True)
    longest = r.max_prompt_tokens + multi_turn.max_response_tokens(r)
    try:
        _check_server(engine, url, student_tokenizer, longest, engine.timeouts)
    finally:
        engine.close()


# A text the served teacher must tokenize as the student does: digits and operators, which every
# tokenizer of a math task has (a character outside a vocabulary tokenizes to <unk> in one copy of
# the tiny tokenizer and to nothing in another, so words would compare how it was loaded).
_TOKENIZE_CHECK = "12+34=46"


def _check_server(engine, url: str, student_tokenizer, longest: int, timeouts) -> None:
    """The served model's context and tokenizer (``served_teacher``)."""
    from grpo_fast.rollout.vllm.deadline import Deadline

    where = f"distill.server_url={url}" if engine.process is None else "distill.placement=server"
    deadline = Deadline(timeouts.request, f"the teacher's vLLM server at {url}", "rollout.request_timeout")
    models = engine.served_models(deadline)
    context = min(int(m.get("max_model_len") or 0) for m in models) if models else 0
    if context < longest:
        raise ConfigError(
            f"{where}: the teacher's server holds {context} tokens a sequence, the run's longest is "
            f"{longest} (rollout.max_prompt_tokens + the longest response): start it with "
            f"--max-model-len {longest} or more"
        )
    ours = student_tokenizer(_TOKENIZE_CHECK, add_special_tokens=False)["input_ids"]
    theirs = engine.tokenize(_TOKENIZE_CHECK, deadline)
    if theirs != list(ours):
        raise ConfigError(
            f"{where}: the teacher's server tokenizes {_TOKENIZE_CHECK!r} as {theirs}, the student as "
            f"{ours}: it must serve distill.teacher (the student's tokenizer and vocabulary)"
        )
