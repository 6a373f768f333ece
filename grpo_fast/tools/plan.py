"""Memory planner: a byte budget for one GPU, and the ``auto`` settings it implies.

    python -m grpo_fast.plan --preset rtx4090 [--gpu-mem-gb 24] [key=value ...]

Two phases share the card and never overlap (vLLM sleeps while the trainer trains):

- training: weights + gradients + optimizer state + autocast's low-precision weight copies
  + activations (per microbatch token; with gradient checkpointing only each layer's input is
  kept, plus one layer recomputed at a time; under ``train.sequence_parallel=N`` a rank holds
  ``⌈L/N⌉`` of each sequence's L tokens, plus the all-to-all's buffers of one layer) + the loss
  chunk (``[rows, V]`` logits and the fp32 lm_head gradient accumulator) + a fixed reserve for the
  CUDA context and fragmentation;
- rollout: the trainer's resident state (weights + optimizer; gradients are freed) + vLLM's
  ``gpu_memory_utilization`` share (its bf16 weights, its activation workspace, its KV cache).

The planner picks the largest microbatch (sequences of ``max_prompt_tokens + max_tokens``; with a
tool environment ``max_prompt_tokens + max_response_tokens``, the inserted tokens counted) whose
training peak fits, the loss chunk rows by the fused op's own rule on CUDA (a 128 MiB budget,
raised to the 2,048 rows that keep its weight-gradient GEMM compute-bound, within 1 GiB: see
``grpo_fast.ops.fused_linear_grpo_loss``), and the vLLM share that the
trainer's resident state leaves free. ``train`` uses it for every setting left at ``auto``.
The estimates are formulas, not measurements; ``bench/`` measures the real peaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

import torch

from grpo_fast.config import AUTO, Config, load_config
from grpo_fast.errors import ConfigError, cli_errors
from grpo_fast.ops.fused_linear_grpo_loss import default_chunk_size
from grpo_fast.rollout.multi_turn import max_response_tokens
from grpo_fast.rollout.registry import backend as rollout_backend

GB = 1e9
RESERVE_BYTES = 1.5 * GB  # CUDA context (~0.5 GB) + allocator fragmentation headroom
VLLM_WORKSPACE_BYTES = 1.5 * GB  # vLLM's activation/sampler workspace measured by its profile run
MAX_MICRO_BATCH = 64
CPU_MICRO_BATCH = 16
# The torch_chunked backend's working set with bf16/fp16 logits: [ROW_TILE, VOCAB_BLOCK] fp32 tiles
# alive at once in its backward (s, p, p·(log p + H), dlogits, ...). Measured with tracked
# allocations: 7 tiles of 4 MiB (29.4 MB) beyond the logits chunk and the weight gradient (N = 768,
# V = 32,768, CPU, 2026-12-01). With fp32 logits the fused head's gradients come from the exps its
# forward leaves in the chunk: one forward tile (FWD_TILE_BYTES) beyond them (74.4 MiB measured
# against 74.0 planned, tests/test_plan.py, 2026-12-03). The Triton kernels keep their tiles in
# registers: nothing.
TORCH_CHUNKED_TILES = 7


@dataclass(frozen=True)
class Arch:
    """What the planner needs of a decoder-only transformer."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters (one FSDP unit under ``train.parallelism=fsdp``)."""
        d, kv = self.hidden, self.kv_heads * self.head_dim
        attn = d * d + 2 * d * kv + d * d + d + 2 * kv  # q, k, v, o (+ q/k/v biases, as Qwen2)
        mlp = 3 * d * self.intermediate
        return attn + mlp + 2 * d  # two RMSNorm weights

    @property
    def root_params(self) -> int:
        """What is not in a decoder layer: the embeddings, the lm_head (tied: the same) and the
        final norm (FSDP's root unit)."""
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear layers, ``name -> (in, out)`` (Qwen2/Llama names)."""
        d, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        return {
            "q_proj": (d, d),
            "k_proj": (d, kv),
            "v_proj": (d, kv),
            "o_proj": (d, d),
            "gate_proj": (d, i),
            "up_proj": (d, i),
            "down_proj": (i, d),
        }

    def lora_params(self, r: int, targets) -> int:
        """Parameters of a rank-``r`` adapter on ``targets`` (``"all-linear"`` or names):
        ``r·(in + out)`` per adapted linear layer."""
        shapes = self.linear_shapes()
        names = list(shapes) if targets == "all-linear" else [t for t in targets if t in shapes]
        return self.layers * sum(r * sum(shapes[n]) for n in names)

    def quantizable_params(self) -> int:
        """The decoder's linear weights: what a 4-bit base stores in NF4 (the embeddings, the
        lm_head and the norms stay in the compute dtype)."""
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    @classmethod
    def from_hf_config(cls, c) -> Arch:
        return cls(
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            heads=c.num_attention_heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            intermediate=c.intermediate_size,
            vocab=c.vocab_size,
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        )


# Offline architectures, so `plan` works without the hub (values from the models' config.json).
KNOWN_ARCHS = {
    "Qwen/Qwen2.5-0.5B": Arch(896, 24, 14, 2, 4864, 151936, True),
    "Qwen/Qwen2.5-1.5B": Arch(1536, 28, 12, 2, 8960, 151936, True),
    "Qwen/Qwen2.5-Math-1.5B": Arch(1536, 28, 12, 2, 8960, 151936, True),
    "Qwen/Qwen2.5-3B": Arch(2048, 36, 16, 2, 11008, 151936, True),
    "Qwen/Qwen2.5-7B": Arch(3584, 28, 28, 4, 18944, 152064, False),
    "Qwen/Qwen2.5-Math-7B": Arch(3584, 28, 28, 4, 18944, 152064, False),
}


def _length_key(cfg: Config) -> str:
    """The key that sets a response's length: ``rollout.max_tokens``, or with a tool environment
    ``rollout.max_response_tokens`` (sampled + inserted tokens)."""
    tools = cfg.rollout.environment != "none"
    return "rollout.max_response_tokens" if tools else "rollout.max_tokens"


def arch_for(cfg: Config) -> Arch:
    name = cfg.model.name_or_path
    if name in KNOWN_ARCHS:
        return KNOWN_ARCHS[name]
    from grpo_fast.task import tiny

    if name in tiny.BUILTINS:
        return Arch.from_hf_config(tiny.build_model_config(tiny.build_tokenizer(name)))
    from transformers import AutoConfig

    try:
        return Arch.from_hf_config(
            AutoConfig.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name_or_path={name!r}: cannot read its config ({exc})") from None


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per item and the picked settings. All sizes in bytes."""

    gpu_bytes: float
    weights: float
    grads: float
    optimizer: float
    autocast_copies: float
    ref_model: float
    activation_per_token: float
    seq_tokens: int
    micro_batch_size: int
    activations: float
    loss_chunk_rows: int
    loss_chunk: float
    reserve: float
    train_peak: float
    vllm_weights: float
    vllm_kv_per_token: float
    vllm_kv_tokens: int
    gpu_memory_utilization: float
    rollout_peak: float
    trainable_params: int = 0
    total_params: int = 0
    frozen_head: bool = False  # LoRA: the lm_head does not train (no fp32 [V, D] gradient)
    vllm_weights_kind: str = "bf16"
    # train.parallelism=fsdp over world_size ranks (sharded): weights, grads, optimizer and ref
    # above are this rank's shards; what FSDP gathers on top; what CPU offload keeps in RAM
    world_size: int = 1
    sharded: bool = False
    gathered_layers: float = 0.0  # 2 layers gathered (current + prefetched) + 1 layer's grads
    gathered_root: float = 0.0  # embeddings + lm_head + norm gathered, + their unsharded grads
    offloaded: float = 0.0  # train.fsdp_cpu_offload: the shards, grads and optimizer in RAM
    sequence_parallel: int = 1  # train.sequence_parallel: a rank holds ⌈seq_tokens / N⌉ of each sequence

    def table(self) -> str:
        g = lambda b: f"{b / GB:8.2f} GB"
        shard = f" (1/{self.world_size} shard)" if self.sharded else ""
        where = shard + (" in CPU RAM" if self.offloaded else "")
        rows = [
            ("card", g(self.gpu_bytes) + (f" × {self.world_size} ranks, per rank:" if self.sharded else "")),
            (
                "trainable parameters",
                f"{self.trainable_params / 1e6:,.1f} M of {self.total_params / 1e6:,.1f} M "
                f"({100 * self.trainable_params / max(self.total_params, 1):.2f}%)",
            ),
            ("-- training phase --", ""),
            ("weights" + where, g(self.weights)),
            ("gradients" + where, g(self.grads)),
            ("optimizer state" + where, g(self.optimizer)),
            *self._sharded_rows(g),
            ("autocast weight copies", g(self.autocast_copies)),
            ("reference model (KL)" + shard, g(self.ref_model)),
            (
                f"activations: {self.activation_per_token / 1e3:.1f} KB/token × {self._tokens_text()} × {self.micro_batch_size}",
                g(self.activations),
            ),
            (
                f"loss chunk: {self.loss_chunk_rows} rows"
                + (" (frozen head: no lm_head grad)" if self.frozen_head else " + fp32 lm_head grad"),
                g(self.loss_chunk),
            ),
            ("CUDA context + fragmentation reserve", g(self.reserve)),
            ("training peak", g(self.train_peak)),
            ("-- rollout phase (vLLM awake, gradients freed) --", ""),
            (
                "trainer resident (weights + optimizer + ref)" + (" in RAM: none" if self.offloaded else ""),
                g(0.0 if self.offloaded else self.weights + self.optimizer + self.ref_model),
            ),
            (f"vLLM weights ({self.vllm_weights_kind})", g(self.vllm_weights)),
            ("vLLM workspace", g(VLLM_WORKSPACE_BYTES)),
            (
                f"vLLM KV cache: {self.vllm_kv_per_token / 1e3:.1f} KB/token × {self.vllm_kv_tokens:,} tokens",
                g(self.vllm_kv_tokens * self.vllm_kv_per_token),
            ),
            ("rollout peak", g(self.rollout_peak)),
            ("-- picked --", ""),
            ("train.micro_batch_size", str(self.micro_batch_size)),
            ("loss.chunk_size", str(self.loss_chunk_rows)),
            ("rollout.gpu_memory_utilization", f"{self.gpu_memory_utilization:.3f}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def _tokens_text(self) -> str:
        """A rank's tokens of each sequence: all of them, or its ⌈L/N⌉ under sequence parallelism."""
        if self.sequence_parallel == 1:
            return str(self.seq_tokens)
        return f"{math.ceil(self.seq_tokens / self.sequence_parallel)} (1/{self.sequence_parallel} of {self.seq_tokens})"

    def _sharded_rows(self, g) -> list[tuple[str, str]]:
        """Under FSDP: what is gathered in flight, and what the CPU offload moves to RAM."""
        if not self.sharded:
            return []
        grads = "adapter's gradients" if self.frozen_head else "gradients"  # LoRA: the base has none
        rows = [
            (f"gathered in flight: 2 layers + 1 layer's {grads}", g(self.gathered_layers)),
            (
                "gathered root: embeddings + lm_head + norm" + ("" if self.frozen_head else ", + gradients"),
                g(self.gathered_root),
            ),
        ]
        if self.offloaded:
            rows.append(("moved to CPU RAM per rank (train.fsdp_cpu_offload)", g(self.offloaded)))
        return rows


def _bytes_per(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, AUTO: 4}[dtype]


# bitsandbytes NF4: 4 bits a value, plus one fp32 absmax per block of 64 values (4 / 64 bytes).
# Under FSDP the packed 4 bits are sharded; the absmaxes stay whole on each rank (on the module).
NF4_ABSMAX_BYTES_PER_PARAM = 4 / 64
NF4_BYTES_PER_PARAM = 0.5 + NF4_ABSMAX_BYTES_PER_PARAM


def _weights(cfg: Config, arch: Arch) -> tuple[float, float, float, float, int]:
    """``(weights, grads, optimizer, autocast copies, trainable parameters)`` in bytes.

    Full fine-tuning: every parameter in ``model.dtype`` (auto: fp32 master weights, with a bf16
    copy under autocast), its gradient, AdamW's two moments (8-bit: 2 B a parameter). LoRA: the
    frozen base in the compute dtype (bf16 under autocast, no master copy; 4-bit: NF4 linears at
    ~0.56 B a parameter), gradients and moments for the adapter's fp32 parameters only."""
    p = arch.num_params
    mixed_auto = cfg.train.mixed_precision != "no"
    lora = cfg.model.lora
    if not lora.r:
        wb = _bytes_per(cfg.model.dtype)
        mixed = mixed_auto and wb == 4
        optimizer = p * (2 if cfg.train.optimizer == "adamw8bit" else 2 * wb)
        return p * wb, p * wb, optimizer, (p * 2 if mixed else 0.0), p
    base_b = 2 if (cfg.model.dtype == AUTO and mixed_auto) else _bytes_per(cfg.model.dtype)
    if cfg.model.load_in_4bit:
        quantized = arch.quantizable_params()
        base = quantized * NF4_BYTES_PER_PARAM + (p - quantized) * base_b
    else:
        base = p * base_b
    adapter = arch.lora_params(lora.r, lora.target_modules)
    optimizer = adapter * (2 if cfg.train.optimizer == "adamw8bit" else 8)
    return base + adapter * 4, adapter * 4, optimizer, (adapter * 2 if mixed_auto else 0.0), adapter


def trainable_params(cfg: Config, arch: Arch) -> int:
    """The parameters that train: all of them, or (LoRA) the adapter's."""
    return _weights(cfg, arch)[4]


def plan_memory(cfg: Config, arch: Arch, gpu_bytes: float, world_size: int = 1) -> MemoryPlan:
    """The budget for ``cfg`` on a card of ``gpu_bytes`` (see the module docstring); under
    ``train.parallelism=fsdp`` the budget of one of ``world_size`` ranks (``_sharded``)."""
    p = arch.num_params
    wb = _bytes_per(cfg.model.dtype)
    lora = cfg.model.lora.r > 0
    mixed = cfg.train.mixed_precision != "no" and (wb == 4 or lora)
    act_b = 2 if (mixed or wb == 2) else 4
    weights, grads, optimizer, autocast_copies, trainable = _weights(cfg, arch)
    # the KL reference: a frozen copy in the compute dtype; under LoRA the base itself (adapter off)
    ref_model = p * act_b if (cfg.loss.beta > 0 or cfg.loss.target_kl) and not lora else 0.0
    sharded = cfg.train.parallelism == "fsdp" and world_size > 1
    gathered_layers = gathered_root = offloaded = 0.0
    # vLLM's copy: bf16, or the base in bitsandbytes 4-bit (QLoRA), and the adapter's slot (whole)
    vllm_weights = (weights - grads) if cfg.model.load_in_4bit else p * 2 + (grads / 2 if lora else 0.0)
    if sharded:
        weights, grads, optimizer, ref_model = _sharded(
            cfg, arch, world_size, weights, grads, optimizer, ref_model
        )
        autocast_copies = 0.0  # the gathered units are in the compute dtype already
        adapter = (_lora_layer_params(cfg, arch), cfg.model.load_in_4bit) if lora else None
        gathered_layers, gathered_root = _gathered(arch, act_b, wb, adapter)
        if cfg.train.fsdp_cpu_offload:
            offloaded = weights + grads + optimizer + ref_model
    L = arch.layers
    per_token = activation_per_token(cfg, arch)
    # prompt + response; a tool's inserted tokens are context in every forward (no logits)
    seq = cfg.rollout.max_prompt_tokens + max_response_tokens(cfg.rollout)
    sp = cfg.train.sequence_parallel
    rank_tokens = math.ceil(seq / sp)  # of each sequence, on this rank
    logits_dtype = torch.bfloat16 if act_b == 2 else torch.float32
    if cfg.loss.chunk_size != AUTO:
        rows = int(cfg.loss.chunk_size)
    else:  # the fused op's own rule on CUDA (memory budget and GEMM-efficiency floor)
        rows = default_chunk_size(seq * MAX_MICRO_BATCH, arch.vocab, logits_dtype, "cuda")
    loss_chunk = _loss_chunk_bytes(cfg.loss.kernel_backend, arch, rows, logits_dtype, lora)
    on_gpu = weights + grads + optimizer + ref_model - offloaded
    fixed = on_gpu + autocast_copies + gathered_layers + gathered_root + loss_chunk + RESERVE_BYTES
    if cfg.train.micro_batch_size != AUTO:
        mbs = int(cfg.train.micro_batch_size)
    else:
        room = gpu_bytes - fixed
        mbs = int(min(MAX_MICRO_BATCH, room // (per_token * rank_tokens))) if room > 0 else 0
        if mbs < 1:
            fix = "train.fsdp_cpu_offload=true, more ranks" if sharded else "train.optimizer=adamw8bit"
            raise ConfigError(
                f"train.micro_batch_size=auto: {fixed / GB:.1f} GB of weights, gradients, optimizer state and "
                f"reserve leave no room for one {seq}-token sequence on a {gpu_bytes / GB:.0f} GB card; enable "
                f"model.gradient_checkpointing, {fix}, or lower {_length_key(cfg)}"
            )
    activations = per_token * rank_tokens * mbs
    train_peak = fixed + activations

    kv_per_token = 2 * L * arch.kv_heads * arch.head_dim * 2  # K and V, bf16
    resident = (0.0 if offloaded else weights + optimizer + ref_model) + RESERVE_BYTES
    if cfg.rollout.gpu_memory_utilization != AUTO:
        util = float(cfg.rollout.gpu_memory_utilization)
    else:
        util = min(0.9, max(0.0, (gpu_bytes - resident) / gpu_bytes))
    kv_tokens = int(max(0.0, util * gpu_bytes - vllm_weights - VLLM_WORKSPACE_BYTES) // kv_per_token)
    return MemoryPlan(
        gpu_bytes=gpu_bytes,
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        autocast_copies=autocast_copies,
        ref_model=ref_model,
        activation_per_token=per_token,
        seq_tokens=seq,
        micro_batch_size=mbs,
        activations=activations,
        loss_chunk_rows=rows,
        loss_chunk=loss_chunk,
        reserve=RESERVE_BYTES,
        train_peak=train_peak,
        vllm_weights=vllm_weights,
        vllm_kv_per_token=kv_per_token,
        vllm_kv_tokens=kv_tokens,
        gpu_memory_utilization=util,
        rollout_peak=resident + util * gpu_bytes,
        trainable_params=trainable,
        total_params=p,
        frozen_head=lora,
        vllm_weights_kind=("4-bit base + adapter" if cfg.model.load_in_4bit else "bf16 + adapter")
        if lora
        else "bf16",
        world_size=world_size,
        sharded=sharded,
        gathered_layers=gathered_layers,
        gathered_root=gathered_root,
        offloaded=offloaded,
        sequence_parallel=sp,
    )


def _sharded(cfg: Config, arch: Arch, world_size: int, *whole: float) -> tuple[float, ...]:
    """One rank's share of ``whole`` (weights, gradients, optimizer state, reference model) under
    FSDP over ``world_size`` ranks: 1/N of each, the 8-bit AdamW state too (bitsandbytes on each
    rank's shards), except a 4-bit base's NF4 block absmaxes, which stay whole on every rank
    (bitsandbytes keeps them on the ``Linear4bit`` module, outside the sharded parameter)."""
    weights, *rest = (x / world_size for x in whole)
    if cfg.model.load_in_4bit:
        weights += arch.quantizable_params() * NF4_ABSMAX_BYTES_PER_PARAM * (1 - 1 / world_size)
    return (weights, *rest)


def activation_per_token(cfg: Config, arch: Arch) -> float:
    """Activation bytes a rank keeps per token it holds (``plan_memory``'s per-token term).

    One layer's activations saved for the backward, per token: norms, q/k/v/o inputs and outputs,
    attention output (flash/SDPA keep no ``[T, T]`` matrix), MLP gate/up/act/product ≈ 10·D + 4·I
    values; with gradient checkpointing only each layer's input, plus one layer recomputed at a
    time. Plus the final hidden states kept in fp32 for the fused loss, and their gradient. Under
    ``train.sequence_parallel=N`` the saved attention tensors are the rank's heads over the whole
    sequence instead of every head over its tokens (the same bytes), and one layer's all-to-all
    buffers come on top: q, k, v and the output sent and received (the key/value heads repeated up
    to N when there are fewer)."""
    wb = _bytes_per(cfg.model.dtype)
    mixed = cfg.train.mixed_precision != "no" and (wb == 4 or cfg.model.lora.r > 0)
    act_b = 2 if (mixed or wb == 2) else 4
    d, i, L = arch.hidden, arch.intermediate, arch.layers
    layer = (10 * d + 4 * i) * act_b
    per_token = (L * d * act_b + layer) if cfg.model.gradient_checkpointing else L * layer
    per_token += d * 4 * 2
    sp = cfg.train.sequence_parallel
    if sp > 1:
        kv = max(arch.kv_heads, sp) * arch.head_dim
        per_token += 2 * (d + 2 * kv + d) * act_b  # q, k, v out and in; the output back
    return float(per_token)


def sequence_parallel_table(
    cfg: Config, arch: Arch, cards_gb: tuple[float, ...] = (24, 80), sizes=(1, 2, 4, 8), world_size: int = 1
) -> list[dict]:
    """For each sp group size N in ``sizes``: whether the model's heads split over N ranks
    (``fits``), the activation bytes a rank holds for one sequence of ``rollout.max_prompt_tokens +
    rollout.max_tokens`` tokens (``activations``), and for each card in ``cards_gb`` the longest
    response (``rollout.max_tokens``) one sequence may have for the training phase to fit
    (``longest[gb]``: microbatch 1, ``loss.chunk_size`` and the rest as configured; 0 when even a
    one-token response does not). Under ``train.parallelism=fsdp`` the weights shard over
    ``max(world_size, N)`` ranks. Formulas, like the rest of the plan (``bench/`` measures)."""
    from grpo_fast.policy.ulysses import fits_heads

    rows = []
    prompt = cfg.rollout.max_prompt_tokens
    for n in sizes:
        one = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1, sequence_parallel=n)
        )
        row = {"size": n, "fits": fits_heads(arch.heads, arch.kv_heads, n), "longest": {}}
        world = max(world_size, n)
        per_token = activation_per_token(one, arch)
        row["activations"] = per_token * math.ceil((prompt + cfg.rollout.max_tokens) / n)
        for gb in cards_gb:
            fixed = plan_memory(one, arch, gb * GB, world)
            room = gb * GB - (fixed.train_peak - fixed.activations)
            tokens = int(room // per_token) * n if room > 0 else 0  # a rank holds ⌈L/N⌉ of L
            row["longest"][gb] = max(0, tokens - prompt)
        rows.append(row)
    return rows


def sequence_parallel_text(cfg: Config, arch: Arch, world_size: int = 1) -> str:
    """``sequence_parallel_table`` as lines: the activation memory per rank at this config's
    sequence length, and the longest response that fits a 24 GB and an 80 GB card, for N = 1, 2, 4, 8."""
    seq = cfg.rollout.max_prompt_tokens + cfg.rollout.max_tokens
    head = (
        f"sequence parallelism (train.sequence_parallel=N; now {cfg.train.sequence_parallel}): activations "
        f"per rank for one {seq}-token sequence, and the longest rollout.max_tokens (prompt "
        f"{cfg.rollout.max_prompt_tokens}, microbatch 1) the training phase fits, by formula (the model's "
        "context length and vLLM's KV cache for it are not counted)"
    )
    lines = [head]
    for row in sequence_parallel_table(cfg, arch, world_size=world_size):
        if not row["fits"]:
            lines.append(
                f"  N = {row['size']}: not possible ({arch.heads} attention heads, {arch.kv_heads} key/value heads)"
            )
            continue
        fits = ", ".join(
            f"{row['longest'][gb]:,} tokens on {gb:g} GB" if row["longest"][gb] else f"none on {gb:g} GB"
            for gb in row["longest"]
        )
        lines.append(
            f"  N = {row['size']}: {row['activations'] / GB:6.2f} GB per rank; longest response {fits}"
        )
    return "\n".join(lines)


def _loss_chunk_bytes(
    backend: str, arch: Arch, rows: int, logits_dtype: torch.dtype, frozen_head: bool
) -> int:
    """The fused loss's memory: one ``[rows, V]`` logits chunk (its gradient is written over it) +
    the fp32 lm_head gradient (none for a frozen head: LoRA) + the kernel backend's working set
    (``auto`` = triton: none; ``torch_chunked``: see ``TORCH_CHUNKED_TILES``)."""
    loss_chunk = rows * arch.vocab * logits_dtype.itemsize + (
        0 if frozen_head else arch.vocab * arch.hidden * 4
    )
    if backend == "torch_chunked":
        from grpo_fast.ops._torch_chunked import FWD_TILE_BYTES, ROW_TILE, VOCAB_BLOCK

        if logits_dtype == torch.float32:
            loss_chunk += FWD_TILE_BYTES
        else:
            loss_chunk += TORCH_CHUNKED_TILES * ROW_TILE * min(VOCAB_BLOCK, arch.vocab) * 4
    return loss_chunk


def _gathered(
    arch: Arch, gathered_bytes: int, weight_bytes: int, lora: tuple[int, bool] | None = None
) -> tuple[float, float]:
    """What FSDP holds unsharded on a rank, in bytes: ``(layers, root)``.

    Layers: the one computing and the one prefetched (in the gathered dtype: bf16 under
    ``train.mixed_precision=bf16``), plus one layer's unsharded gradient and its reduce-scatter
    input (fp32 under bf16: gradients reduce in fp32). The root (embeddings, lm_head, final norm)
    stays gathered through each microbatch's forward and backward, with its unsharded gradient
    and reduce-scatter input at the end (the fused head's fp32 accumulator is the loss chunk's).

    Under LoRA (``lora``: the adapter's parameters in one layer, and whether the base is 4-bit):
    the frozen base is gathered in its own dtype (the compute dtype; a 4-bit base's linear
    weights as their packed NF4 bytes, half a byte each) with the adapter beside it; only the
    adapter has a gradient (reduced in fp32), the root none.
    """
    reduce_bytes = 4 if gathered_bytes < weight_bytes else weight_bytes
    layer, root = arch.layer_params, arch.root_params
    if lora is None:
        layers = 2 * layer * gathered_bytes + layer * (gathered_bytes + reduce_bytes)
        return float(layers), float(root * (2 * gathered_bytes + reduce_bytes))
    adapter, nf4 = lora
    linear = arch.quantizable_params() // arch.layers if nf4 else 0
    base = linear * 0.5 + (layer - linear) * gathered_bytes
    layers = 2 * (base + adapter * gathered_bytes) + adapter * (gathered_bytes + 4)
    return float(layers), float(root * gathered_bytes)


def _lora_layer_params(cfg: Config, arch: Arch) -> int:
    """The adapter's parameters in one decoder layer (one FSDP unit)."""
    lora = cfg.model.lora
    return arch.lora_params(lora.r, lora.target_modules) // arch.layers


def resolve_auto(cfg: Config, model_config, device: torch.device, world_size: int = 1) -> Config:
    """``cfg`` with every planner-owned ``auto`` replaced by a number (the loss chunk stays
    ``auto``: the fused op sizes it from its own memory budget)."""
    t, r = cfg.train, cfg.rollout
    if device.type != "cuda":
        mbs = t.micro_batch_size if t.micro_batch_size != AUTO else CPU_MICRO_BATCH
        util = r.gpu_memory_utilization if r.gpu_memory_utilization != AUTO else 0.5
    else:
        total = torch.cuda.get_device_properties(device).total_memory
        plan = plan_memory(cfg, Arch.from_hf_config(model_config), total, world_size)
        mbs, util = plan.micro_batch_size, plan.gpu_memory_utilization
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(t, micro_batch_size=int(mbs)),
        rollout=dataclasses.replace(r, gpu_memory_utilization=float(util)),
    )


def clamp_micro_batch(cfg: Config, world_size: int = 1) -> tuple[Config, str | None]:
    """``cfg`` with ``train.micro_batch_size`` at most the responses one rank trains on per step
    (``rollout.batch_size / world_size``: a larger microbatch is that one), and the line that
    says so when it was larger (None otherwise).

    Example: ``train.micro_batch_size=1000`` with ``rollout.batch_size=256`` → 256, and
    ``"train.micro_batch_size=1000 is more than the 256 responses a rank trains on per step: ..."``.
    """
    per_rank = max(1, cfg.rollout.batch_size // world_size)
    mbs = cfg.train.micro_batch_size
    if mbs == AUTO or int(mbs) <= per_rank:
        return cfg, None
    line = (
        f"train.micro_batch_size={mbs} is more than the {per_rank} responses a rank trains on per "
        f"step: microbatches of {per_rank}"
    )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=per_rank)), line


def smallest_need(cfg: Config, arch: Arch, gpu_bytes: float, world_size: int = 1) -> float:
    """The fewest bytes a card needs for ``cfg``: training with microbatch 1, and (vLLM) the
    trainer's resident state plus vLLM's weights, workspace and one sequence of KV cache."""
    one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1))
    mp = plan_memory(one, arch, gpu_bytes, world_size)
    need = mp.train_peak
    if rollout_backend(cfg.rollout.backend).needs_weight_push:  # an engine with its own weights
        resident = (0.0 if mp.offloaded else mp.weights + mp.optimizer + mp.ref_model) + mp.reserve
        kv = mp.seq_tokens * mp.vllm_kv_per_token
        need = max(need, resident + mp.vllm_weights + VLLM_WORKSPACE_BYTES + kv)
    return need


@cli_errors
def main(argv: list[str] | None = None, prog: str = "python -m grpo_fast.plan") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Print the memory budget of a preset.")
    p.add_argument("--preset", default="rtx4090")
    p.add_argument("--config", action="append", default=[], metavar="FILE.yaml")
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="card size (default: this GPU's, else 24)")
    p.add_argument(
        "--world-size",
        type=float,
        default=1,
        help="ranks (GPUs) of the run: with train.parallelism=fsdp the budget is one rank's (default 1)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    cfg = load_config(args.preset, args.config, args.overrides, check_device=False)
    if not (
        math.isfinite(args.world_size) and args.world_size >= 1 and args.world_size == int(args.world_size)
    ):
        raise ConfigError(
            f"--world-size must be a whole number of ranks, at least 1; got {args.world_size:g}"
        )
    world = int(args.world_size)
    if args.gpu_mem_gb is not None and not (math.isfinite(args.gpu_mem_gb) and args.gpu_mem_gb > 0):
        raise ConfigError(f"--gpu-mem-gb must be a card size in GB, above 0; got {args.gpu_mem_gb:g}")
    if args.gpu_mem_gb is not None:
        gpu = args.gpu_mem_gb * GB
    elif torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0).total_memory
    else:
        gpu = 24 * GB
    need = smallest_need(cfg, arch_for(cfg), gpu, world)
    if need > gpu:
        fixes = [f"a lower {_length_key(cfg)}"]
        fixes += [] if cfg.model.gradient_checkpointing else ["model.gradient_checkpointing=true"]
        if cfg.train.parallelism == "fsdp":
            fixes += [] if cfg.train.fsdp_cpu_offload else ["train.fsdp_cpu_offload=true"]
            fixes += ["more ranks (--world-size)"]
        else:
            fixes += [] if cfg.train.optimizer == "adamw8bit" else ["train.optimizer=adamw8bit"]
            fixes += ["train.parallelism=fsdp on several GPUs"]
        kv = (
            ", one sequence of vLLM KV cache"
            if rollout_backend(cfg.rollout.backend).needs_weight_push
            else ""
        )
        raise ConfigError(
            f"a {gpu / GB:.1f} GB card is too small for preset {args.preset!r}: its smallest plan "
            f"(microbatch 1{kv}) needs {need / GB:.1f} GB; try {', '.join(fixes)}"
        )
    plan = plan_memory(cfg, arch_for(cfg), gpu, world)
    print(
        f"memory plan for preset {args.preset!r}: {cfg.model.name_or_path} ({arch_for(cfg).num_params / 1e9:.2f} B parameters)"
    )
    if world > 1 and not plan.sharded:
        print(f"train.parallelism=ddp: every one of the {world} ranks holds all of this (fsdp shards it)")
    print(plan.table())
    if plan.train_peak > gpu or plan.rollout_peak > gpu:
        print(
            f"warning: the plan exceeds the card ({max(plan.train_peak, plan.rollout_peak) / GB:.1f} GB > {gpu / GB:.1f} GB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
