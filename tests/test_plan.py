"""The memory planner against measurement: a scaled-down Qwen2 (4 layers, D = 512, V = 32,768,
tied) on CPU, fp32, every allocation tracked (``grpo_fast.obs.memory.tracked_peak_bytes``).

Each of the planner's per-phase items must be within 15% of what is measured: weights, gradients
and optimizer state (bytes of the tensors after a real step), activations per token (the growth
of a forward + backward's peak between 1,024 and 2,048 tokens, so what does not scale with tokens
cancels out), with and without gradient checkpointing, the loss chunk (the fused op's peak on
top of its inputs and outputs), and what the trainer keeps through the rollout phase.
"""

import pytest
import torch
from transformers import Qwen2Config

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.obs.memory import tracked_peak_bytes
from grpo_fast.ops import fused_linear_grpo_loss
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import build_policy_loss, response_hidden_states
from grpo_fast.policy.model import load_policy
from grpo_fast.rollout import Rollout
from grpo_fast.tools.plan import Arch, plan_memory

HF = Qwen2Config(
    vocab_size=32768,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
PROMPT, RESPONSE, CHUNK = 32, 96, 64


def _cfg(checkpointing: bool):
    return load_config(
        "tiny",
        overrides=[
            "model.name_or_path=scaled-down-qwen2",
            "model.dtype=float32",
            "train.mixed_precision=no",
            f"model.gradient_checkpointing={str(checkpointing).lower()}",
            f"rollout.max_prompt_tokens={PROMPT}",
            f"rollout.max_tokens={RESPONSE}",
            "train.micro_batch_size=8",
            f"loss.chunk_size={CHUNK}",  # a fixed chunk: the loss's memory does not grow with N
            "loss.kernel_backend=torch_chunked",
        ],
        check_device=False,
    )


def _microbatch(b: int):
    g = torch.Generator().manual_seed(b)
    prompts = [torch.randint(0, HF.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(b)]
    responses = [torch.randint(0, HF.vocab_size, (RESPONSE,), generator=g).tolist() for _ in range(b)]
    seqs = loss_trajectories(
        Rollout(prompts, responses),
        advantages=torch.randn(b),
        length_norm="sequence_mean",
        max_length=RESPONSE,
    )
    return make_microbatches(seqs, b, 0, packing=False)[0]


def _within(name: str, planned: float, measured: float, tol: float = 0.15) -> None:
    print(f"{name:28s} planned {planned / 1e6:11.4f} MB   measured {measured / 1e6:11.4f} MB")
    assert abs(planned - measured) <= tol * measured, (name, planned, measured)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_planner_bytes_match_measurement(checkpointing):
    torch.manual_seed(0)
    cfg = _cfg(checkpointing)
    model = load_policy(cfg, None, torch.device("cpu"), hf_config=HF)
    plan = plan_memory(cfg, Arch.from_hf_config(HF), gpu_bytes=80e9)
    loss = build_policy_loss(cfg, model, None)
    optimizer = build_optimizer(cfg, model.parameters())

    def forward_backward(mb):
        return lambda: loss(mb, LossOptions(), 1.0).loss.backward()

    forward_backward(_microbatch(2))()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    _within("weights", plan.weights, _nbytes(model.parameters()))
    _within("gradients", plan.grads, _nbytes(p.grad for p in model.parameters()))
    _within("optimizer state", plan.optimizer, _nbytes(state))

    small, large = _microbatch(8), _microbatch(16)  # 1,024 and 2,048 tokens
    per_token = (
        tracked_peak_bytes(forward_backward(large)) - tracked_peak_bytes(forward_backward(small))
    ) / (8 * (PROMPT + RESPONSE))
    _within("activations per token", plan.activation_per_token, per_token)

    # the loss chunk: the fused op's own peak beyond its output gradient grad_hidden [n, D]
    with torch.no_grad():
        hidden = response_hidden_states(model, small)
    hidden.requires_grad_(True)
    head = model.get_output_embeddings().weight
    op = lambda: fused_linear_grpo_loss(
        hidden,
        head,
        small.labels,
        small.advantages,
        small.loss_weights,
        chunk_size=CHUNK,
        backend="torch_chunked",
    ).loss.backward()
    op_peak = tracked_peak_bytes(op) - hidden.numel() * 4
    _within("loss chunk", plan.loss_chunk, op_peak)

    # the rollout phase: gradients freed, weights and optimizer state stay
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    kept = _nbytes(model.parameters()) + _nbytes(state)
    _within("trainer state in rollout", plan.weights + plan.optimizer, kept)


def test_a_tool_environment_counts_the_inserted_tokens_in_the_sequence():
    """With rollout.environment the planned sequence is max_prompt_tokens + max_response_tokens
    (sampled + inserted: auto = max_tokens + max_tool_calls × max_tool_output_tokens); the
    activations grow with it."""
    from grpo_fast.tools.plan import KNOWN_ARCHS, plan_memory

    base = ["train.micro_batch_size=2", "rollout.max_prompt_tokens=512", "rollout.max_tokens=1024"]
    arch = KNOWN_ARCHS["Qwen/Qwen2.5-Math-1.5B"]
    plans = {}
    for name, extra in {
        "none": [],
        "auto": [
            "rollout.environment=calculator",
            "rollout.max_tool_calls=3",
            "rollout.max_tool_output_tokens=100",
        ],
        "set": ["rollout.environment=calculator", "rollout.max_response_tokens=2000"],
    }.items():
        cfg = load_config("rtx4090", overrides=[*base, *extra], check_device=False)
        plans[name] = plan_memory(cfg, arch, 24e9)
    assert [plans[k].seq_tokens for k in ("none", "auto", "set")] == [1536, 1836, 2512]
    assert plans["none"].activations < plans["auto"].activations < plans["set"].activations
