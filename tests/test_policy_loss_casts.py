"""PolicyLoss under bf16 autocast: one ``[V, D]`` cast of the fp32 lm_head weight per optimizer
step, not one per microbatch, with the same numbers as a cast per call; no label read per
microbatch; and (``gpu``) no host-device sync in a microbatch step."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.ops import fused_linear_grpo_loss
from grpo_fast.policy.batch import Microbatch
from grpo_fast.policy.loss import PolicyLoss

V, D = 1003, 80  # sizes no other buffer of the one-layer policy shares
MICROBATCHES = 4


def _tied_policy(v: int, d: int, seed: int = 0):
    """A one-layer fp32 Qwen2 with tied embeddings, and one microbatch of 2 rows of 24 tokens
    whose last 15 positions each predict a response token (n = 30), built on the CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=v, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).float().train()
    ids = torch.randint(0, v, (2, 24))
    select = torch.zeros(2, 24, dtype=torch.bool)
    select[:, 8:-1] = True
    labels = ids[:, 1:][select[:, :-1]]
    n = labels.numel()
    mb = Microbatch(
        input_ids=ids, attention_mask=None, position_ids=None, select=select, labels=labels,
        advantages=torch.randn(n), loss_weights=torch.rand(n) / n, old_logprobs=-7.0 + 0.3 * torch.randn(n),
    )  # fmt: skip
    return model, mb


def _head_casts(run) -> int:
    """How many ``aten::_to_copy`` of a ``[V, D]`` tensor ``run()`` issues (torch.profiler, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return sum(
        e.name == "aten::_to_copy" and bool(e.input_shapes) and list(e.input_shapes[0]) == [V, D]
        for e in prof.events()
    )


def _policy(model) -> PolicyLoss:
    return PolicyLoss(model, autocast=torch.bfloat16, backend="torch_chunked")


def test_lm_head_is_cast_once_per_optimizer_step():
    """One optimizer step of 4 microbatches: 1 cast of the [V, D] weight, not 4.

    Measured 2026-12 (CPU, torch 2.13, tied V = 1,003, D = 80; 4 microbatches per step): 4 -> 1
    cast per step (8 -> 2 over two steps). The cached copy is dropped right after the step (none
    is alive while the next rollout runs); the next forward casts the updated weight.
    """
    model, mb = _tied_policy(V, D)
    policy = _policy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        for _ in range(MICROBATCHES):
            policy(mb, LossOptions(), 1.0).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    casts = _head_casts(step)
    print(f"[V, D] casts in one step of {MICROBATCHES} microbatches: {casts}")
    assert casts == 1
    assert policy._head_cast is None  # freed by the step post-hook


def test_cached_cast_gives_the_numbers_of_a_cast_per_call():
    """Gradients accumulated over 2 microbatches, the optimizer step, and the next step's
    log-probs are bitwise those of the op casting the weight itself on every call (tied fp32
    master weight, bf16 autocast)."""
    model, mb = _tied_policy(V, D)
    twin = copy.deepcopy(model)
    cached, per_call = _policy(model), _policy(twin)
    per_call._head_in_compute_dtype = lambda head: None  # the op casts, every call
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    for _ in range(2):
        for _ in range(2):
            cached(mb, LossOptions(), 1.0).loss.backward()
            per_call(mb, LossOptions(), 1.0).loss.backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        assert torch.equal(cached(mb, LossOptions(), 1.0).logprobs, per_call(mb, LossOptions(), 1.0).logprobs)


def test_an_optimizer_that_does_not_bump_the_version_still_recasts():
    """bitsandbytes' 8-bit AdamW (0.50, CPU) writes the weights without bumping ``_version``:
    the step post-hook drops the copy, so the next forward sees the updated weight."""
    bnb = pytest.importorskip("bitsandbytes")
    model, mb = _tied_policy(V, D)
    policy = _policy(model)
    head = model.get_output_embeddings().weight
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    policy(mb, LossOptions(), 1.0).loss.backward()
    version = head._version
    opt.step()
    assert head._version == version  # what makes the hook necessary
    with torch.no_grad():
        assert torch.equal(
            policy(mb, LossOptions(), 1.0).logprobs, _policy(model)(mb, LossOptions(), 1.0).logprobs
        )


def test_an_in_place_update_outside_an_optimizer_recasts():
    """A weight changed in place (``load_state_dict``, ``copy_``) bumps its ``_version``: the
    next forward casts again and sees the new values."""
    model, mb = _tied_policy(V, D)
    policy = _policy(model)
    with torch.no_grad():
        before = policy(mb, LossOptions(), 1.0).logprobs
        model.get_output_embeddings().weight.mul_(2.0)
        after = policy(mb, LossOptions(), 1.0).logprobs
        fresh = _policy(model)(mb, LossOptions(), 1.0).logprobs
    assert not torch.equal(before, after)
    assert torch.equal(after, fresh)


def test_the_label_range_check_reads_no_tensor_given_the_bounds(monkeypatch):
    """Microbatch.label_bounds (read on the CPU at construction) replace the aminmax read of the
    labels, and the check still refuses a label out of [0, V)."""
    model, mb = _tied_policy(V, D)
    assert mb.label_bounds == tuple(int(x) for x in torch.aminmax(mb.labels))
    policy = _policy(model)
    labels = mb.labels.clone()
    labels[0] = V  # out of range; the builder reads the bounds (min, V)
    bad = Microbatch(**{**mb.__dict__, "labels": labels, "label_bounds": None})
    assert bad.label_bounds == (int(labels.min()), V)

    def no_read(*_a, **_k):
        raise AssertionError("the labels were read")

    monkeypatch.setattr(torch, "aminmax", no_read)
    policy(mb, LossOptions(), 1.0)  # runs: the bounds are used
    with pytest.raises(
        ValueError, match=r"labels must be in \[0, V\) = \[0, 1003\), got min \d+ and max 1003"
    ):
        policy(bad, LossOptions(), 1.0)
    with pytest.raises(ValueError, match="weight_cast must be"):
        head = model.get_output_embeddings().weight
        fused_linear_grpo_loss(
            torch.zeros(2, D), head, torch.tensor([1, 2]), torch.ones(2), torch.ones(2),
            weight_cast=head.to(torch.float16), compute_dtype=torch.bfloat16, label_bounds=(1, 2),
        )  # fmt: skip


class _CastCounter:
    """Counts fp32 → bf16 ``aten._to_copy`` calls on tensors of ``shape`` (forward casts of that
    weight; the backward's casts of its gradient go bf16 → fp32 and are not counted)."""

    def __init__(self, shape):
        self.shape, self.count = tuple(shape), 0

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                x = args[0] if args else None
                if (
                    func is torch.ops.aten._to_copy.default
                    and isinstance(x, torch.Tensor)
                    and tuple(x.shape) == counter.shape
                    and x.dtype == torch.float32
                    and kwargs.get("dtype") == torch.bfloat16
                ):
                    counter.count += 1
                return func(*args, **kwargs)

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("held", [False, True])
def test_backbone_weights_are_cast_once_per_optimizer_step(held):
    """One optimizer step of 4 microbatches through ``optimize_on_rollout``'s pattern: held in
    ``PolicyLoss.step_cast_cache`` (as the loop does), the MLP's down-projection is cast to bf16
    once; without it, once per microbatch (4). The gradients are bitwise the same.

    Measured 2026-12 (CPU, torch 2.13, one Qwen2 layer D = 80, 4 microbatches): 4 -> 1 cast
    of each backbone weight per step."""
    import contextlib

    model, mb = _tied_policy(V, D)
    policy = _policy(model)
    down = model.model.layers[0].mlp.down_proj.weight  # [D, 2D], the only weight of that shape

    def grads(hold: bool):
        model.zero_grad(set_to_none=True)
        region = policy.step_cast_cache(mb.input_ids.device) if hold else contextlib.nullcontext()
        with _CastCounter(down.shape) as counter, region:
            for _ in range(MICROBATCHES):
                policy(mb, LossOptions(), 1.0).loss.backward()
        return counter.count, {n: p.grad.clone() for n, p in model.named_parameters()}

    casts, got = grads(held)
    print(f"down_proj casts in one step of {MICROBATCHES} microbatches (held={held}): {casts}")
    assert casts == (1 if held else MICROBATCHES)
    _, per_call = grads(not held)
    for name, g in got.items():
        assert torch.equal(g, per_call[name]), name


def test_the_loop_holds_the_cast_cache_over_a_step():
    """``optimize_on_rollout`` itself: 4 microbatches, one bf16 cast of the down-projection."""
    from grpo_fast.config import load_config
    from grpo_fast.loop.optimization import optimize_on_rollout
    from grpo_fast.loop.state import Trainer

    model, mb = _tied_policy(V, D)
    policy = _policy(model)
    cfg = load_config("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(policy, opt, list(model.parameters()), cfg)
    with _CastCounter(model.model.layers[0].mlp.down_proj.weight.shape) as counter:
        optimize_on_rollout(trainer, [mb] * MICROBATCHES, options=LossOptions(), temperature=1.0)
    assert counter.count == 1


@pytest.mark.gpu
def test_microbatch_step_issues_no_host_device_sync():
    """One optimizer step of 2 microbatches (PolicyLoss forward + backward, clip_grad_norm_,
    AdamW) on CUDA under ``torch.cuda.set_sync_debug_mode("error")``: any sync raises.

    The backbone is a stand-in (embedding + linear, the lm_head tied to the embedding) because
    transformers 5.24's mask preparation reads the mask or the position ids once per forward
    (``find_packed_sequence_indices``, ``_ignore_causal_mask_sdpa``), a sync that is not ours.
    What runs here is all of ours: the response gather, the label check, the lm_head cast
    cache, the fused op (triton), its backward and the optimizer step.
    """
    from types import SimpleNamespace

    from grpo_fast.policy.batch import Sequence, make_microbatches

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, D)
            self.proj = torch.nn.Linear(D, D)

        def forward(self, input_ids, **_):
            return SimpleNamespace(last_hidden_state=self.proj(self.embed(input_ids)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = Decoder()
            self.config = SimpleNamespace(_attn_implementation="sdpa")

        def get_decoder(self):
            return self.decoder

        def get_output_embeddings(self):
            return self.decoder.embed  # tied: the embedding's weight is the lm_head's

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Model().to(device)
    policy = PolicyLoss(model, autocast=torch.bfloat16, backend="triton")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    seqs = [Sequence(torch.randint(0, V, (24,)).tolist(), 8, a, 1 / 64) for a in (1.0, -1.0, 0.5, -0.5)]
    mbs = [mb.to(device) for mb in make_microbatches(seqs, 2, pad_id=0, packing=False)]
    policy(mbs[0], LossOptions(), 1.0).loss.backward()  # warm-up: triton compiles, the allocator grows
    opt.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):  # the guard is armed: a sync raises
            torch.ones(1, device=device).item()
        for mb in mbs:
            policy(mb, LossOptions(), 1.0).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # the step ran
