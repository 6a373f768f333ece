"""A fleet of vLLM engines apart from the trainer (``rollout.num_engines`` > 1 with
``rollout.placement=process|server``, or a list of URLs in ``rollout.server_url``): one
``VLLMBackend`` per engine behind ``grpo_fast.rollout.fleet.Fleet``, which balances the shards,
loads every version on every engine at once, and takes an engine that dies, times out or fails
its probe out of service.

- **Engines.** Engine ``i`` is ``engine_apart(..., index=i)``: a server the run starts on a free
  port (its log ``output_dir/vllm_server.<i>.log``, its GPUs ``rollout.engine_devices[i]``), an
  ``AsyncLLM`` engine process, or the server at ``rollout.server_url[i]``. A restart starts a
  fresh server or process; for a listed server it attaches again (the weight-transfer handshake
  with whatever now listens at that URL), so a server its own supervisor brought back rejoins.
- **Weights.** A version is staged once: the host copies of what a push sends, and the trainer's
  probe log-probs of them (``staged_weights``, whatever ``keep`` asks: every engine and every
  restart loads the same version). The fleet's ``share`` then writes the tensors into
  ``/dev/shm`` once, in the engines' dtype (``StagedShm``), and drops the host copies: every
  engine's transport loads those same files (one write a version, not one an engine), and so does
  an engine restarted later; the files stay until the next version is written (``/dev/shm``
  holds one version: its size in that dtype). Each engine is probed against the staged
  log-probs; ``rollout/weight_sync_abs_diff`` is the largest of the engines' probes. A QLoRA base
  (``model.load_in_4bit``, ``rollout.lora_sync=adapter``) is written dequantized once per run
  and loaded by each engine before its first adapter; an adapter (a few MiB) is written by each
  engine's own push.
- **Multi-turn.** Each engine has its own ``ToolRollout`` (its own environment and a copy of the
  tokenizer): the engines' turns run at once in threads of this process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from grpo_fast.rollout import multi_turn
from grpo_fast.rollout.base import BackendContext
from grpo_fast.rollout.fleet import Fleet
from grpo_fast.rollout.vllm.placement.apart import engine_apart
from grpo_fast.rollout.vllm.transfer.transport import StagedShm
from grpo_fast.rollout.vllm.transfer.weights import dequantized_base_tensors, staged_weights


def vllm_fleet(
    ctx: BackendContext,
    path: str,
    dtype: str,
    lora_rank: int,
    lora_sync: str | None,
    member: Callable[..., Any],
    start_engine: Callable[[int], Any] | None = None,
) -> Fleet:
    """The fleet of ``fleet_size`` engines (module docstring), started; nothing loaded yet (the
    caller's ``sync_weights``). ``member``: the backend over one engine (``VLLMBackend``, passed
    in: that module builds the fleet); ``start_engine(i)``: engine ``i`` (default ``engine_apart``); the
    warning lines go to ``ctx.warn`` (default: the ``grpo_fast`` logger's)."""
    from grpo_fast.rollout.fleet import fleet_size

    cfg, r = ctx.cfg, ctx.cfg.rollout
    push_base = bool(lora_sync == "adapter" and cfg.model.load_in_4bit)
    start_engine = start_engine or (lambda i: engine_apart(cfg, path, dtype, lora_rank, index=i))
    base: dict[str, Any] = {}  # a QLoRA base, dequantized once per run

    def start(i: int):
        engine = start_engine(i)
        tokenizer = ctx.tokenizer if r.environment == "none" else copy.deepcopy(ctx.tokenizer)
        return member(
            engine,
            tokenizer,
            sleep_level=r.sleep_level,
            probe=ctx.probe,
            lora_sync=lora_sync,
            push_base=push_base,
            tools=multi_turn.from_config(cfg, tokenizer),
        )

    trainer: dict[str, Any] = {}
    serving_dtype = getattr(torch, dtype)
    written: dict[str, StagedShm] = {}  # the version the fleet serves, in /dev/shm

    def stage(model, keep: bool = True) -> dict:
        trainer["model"] = model  # whose adapter configuration an adapter push writes
        staged = staged_weights(model, lora_sync, ctx.probe)
        if push_base:
            if "tensors" not in base:
                base["tensors"] = StagedShm(dequantized_base_tensors(model), serving_dtype)
            staged["base"] = base["tensors"]
        return staged

    def share(staged: dict) -> dict:
        """The staged version as every engine loads it: its tensors written once (module
        docstring). Runs under the fleet's load lock, so no load reads the previous version's
        files when they go."""
        if lora_sync == "adapter":
            return staged
        if "version" in written:
            written.pop("version").close()
        written["version"] = StagedShm(staged["tensors"].items(), serving_dtype)
        return {**staged, "tensors": written["version"]}

    def load(backend, staged: dict, version: int) -> None:
        backend._trainer_model = trainer.get("model")  # what its own stage would have set
        backend.load_weights(staged, version)

    warn = ctx.warn
    if warn is None:
        import logging

        warn = logging.getLogger("grpo_fast").warning
    return Fleet(
        start,
        share,
        load,
        stage,
        num_engines=fleet_size(r),
        min_engines=r.min_engines,
        generation_batch_size=r.generation_batch_size,
        warn=warn,
        what="vLLM " + ("server" if r.placement == "server" else "engine process"),
        on_close=lambda: [files.close() for files in (*written.values(), *base.values())],
    )
