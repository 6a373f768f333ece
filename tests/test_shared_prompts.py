"""``train.share_prompts``: each prompt computed once for all its responses (``[prompt, r_1 … r_G]``
rows, grpo_fast/policy/batch.py ``shared_prompt_microbatches``, attended by
grpo_fast/policy/shared_attention.py). The loss, the
per-token log-probs and every parameter's gradient equal the unshared layout's to fp32 summation
order: padded and packed, with gradient checkpointing, a group split across microbatches or kept
whole, some responses left out (the zero-advantage skip), at token and sequence (GSPO) level."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.rollout import Rollout
from grpo_fast.task import tiny

GROUP = 4


@pytest.fixture(params=["dense", "gathered"])
def attention_path(request, monkeypatch):
    """Both ways the shared attention runs: one dense block mask per row (rows up to
    ``DENSE_MAX_WIDTH`` tokens) and the per-response gathers (longer rows), each forced here."""
    from grpo_fast.policy import shared_attention

    monkeypatch.setattr(shared_attention, "DENSE_MAX_WIDTH", 10**9 if request.param == "dense" else 0)
    return request.param


def _rollout(seed: int = 0):
    """3 prompts of different lengths × 4 responses of 1-5 tokens (EOS-terminated), advantages."""
    tok = tiny.build_tokenizer()
    prompts = [tok(q)["input_ids"] for q in ("12+34=", "7+8=", "61+9=")]
    g = torch.Generator().manual_seed(seed)
    responses = [
        [*torch.randint(3, 15, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist(), 1]
        for _ in range(len(prompts) * GROUP)
    ]
    adv = torch.randn(len(responses), generator=g)
    seqs = loss_trajectories(
        Rollout(prompts, responses), advantages=adv, length_norm="sequence_mean", max_length=6
    )
    return tok, seqs


def _step(model, seqs, pad_id, micro_batch_size, **layout):
    """Loss, per-response log-probs (by response index) and gradients of one accumulated step."""
    model = copy.deepcopy(model)
    loss_fn = PolicyLoss(model, autocast=None, backend="torch_chunked")
    total, logprobs = 0.0, {}
    mbs = make_microbatches(seqs, micro_batch_size, pad_id, **layout)
    for mb in mbs:
        out = loss_fn(mb, LossOptions(), 0.8)
        out.loss.backward()
        total += out.loss.item()
        for i in mb.response_index.unique().tolist():
            logprobs[i] = out.logprobs[mb.response_index == i]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, logprobs, grads, mbs


def _assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-6, abs=1e-7)
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        torch.testing.assert_close(b[1][i], a[1][i], rtol=0, atol=2e-6)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        scale = a[2][name].abs().max().item()
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-6 * max(scale, 1.0), msg=name)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("micro_batch_size", [GROUP, 3, 12], ids=["whole-groups", "split-groups", "one-mb"])
def test_shared_prompts_give_the_unshared_loss_logprobs_and_gradients(
    packing, micro_batch_size, attention_path
):
    tok, seqs = _rollout()
    model = tiny.build_model(tok, seed=0)
    unshared = _step(model, seqs, tok.pad_token_id, micro_batch_size, packing=packing)
    shared = _step(model, seqs, tok.pad_token_id, micro_batch_size, packing=packing, share_prompts=True)
    _assert_same(unshared, shared)
    # each prompt once per microbatch it reaches: fewer tokens through the decoder
    n_tokens = lambda mbs: sum(int((mb.input_ids != tok.pad_token_id).sum()) for mb in mbs)
    assert n_tokens(shared[3]) < n_tokens(unshared[3])
    assert all(len(mb.labels) <= micro_batch_size * 6 for mb in shared[3])


def test_with_gradient_checkpointing_gspo_and_responses_left_out(attention_path):
    """Checkpointed layers recompute with the same layout; GSPO's sequence ratio over the
    shared layout's sequence ids; a group with some responses left out (as the zero-advantage
    skip leaves it) keeps its prompt for the rest, and a group with none left has no prompt."""
    from grpo_fast.policy.model import enable_checkpointing

    tok, seqs = _rollout(seed=1)
    kept = [s for i, s in enumerate(seqs) if i % GROUP != 0 and i // GROUP != 2]  # group 2 gone entirely
    model = tiny.build_model(tok, seed=0)
    enable_checkpointing(model)
    model.train()
    old = {}  # by position in kept (Microbatch.response_index)
    for j, s in enumerate(kept):  # an off-policy π_old, so that GSPO's ratio is not 1
        old[j] = torch.randn(s.num_tokens, generator=torch.Generator().manual_seed(j))
    gspo = LossOptions(importance_sampling_level="sequence", clip_low=0.02, clip_high=0.03)
    results = []
    for share in (False, True):
        m = copy.deepcopy(model)
        loss_fn = PolicyLoss(m, autocast=None, backend="torch_chunked")
        total = 0.0
        mbs = make_microbatches(kept, 3, tok.pad_token_id, packing=False, share_prompts=share)
        for mb in mbs:
            mb.old_logprobs = torch.cat([old[i][: int((mb.response_index == i).sum())] for i in _order(mb)])
            out = loss_fn(mb, gspo, 1.0)
            out.loss.backward()
            total += out.loss.item()
        results.append(
            (total, {}, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, mbs)
        )
    _assert_same(results[0], results[1])
    prompts_in = [int((mb.input_ids[:, :3] != tok.pad_token_id).any()) for mb in results[1][3]]
    assert len(prompts_in) == 2  # 6 responses, 3 a microbatch: the 2 kept groups, no row for group 2


def _order(mb) -> list[int]:
    """The response indices of ``mb`` in the order of its labels."""
    seen = []
    for i in mb.response_index.tolist():
        if not seen or seen[-1] != i:
            seen.append(i)
    return seen


def test_flash_attention_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match=r"train\.share_prompts=true runs its own attention around sdpa or eager"
    ):
        load_config(
            "tiny", overrides=["train.share_prompts=true", "model.attn_implementation=flash_attention_2"]
        )


def test_the_key_reaches_the_loop_microbatches(tmp_path, monkeypatch):
    """The optimization phase builds shared-prompt microbatches exactly with the key on."""
    from grpo_fast import train as train_mod
    from grpo_fast.loop import optimization

    seen = []
    real = optimization.make_microbatches
    monkeypatch.setattr(
        optimization,
        "make_microbatches",
        lambda *a, **k: seen.append(k.get("share_prompts")) or real(*a, **k),
    )
    for share in ("false", "true", "auto"):
        quick = ["steps=1", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16",
                 "logging.progress=false", "train.skip_zero_advantage=false", f"output_dir={tmp_path / share}"]  # fmt: skip
        train_mod.run(load_config("tiny", overrides=[*quick, f"train.share_prompts={share}"]))
    assert seen == [False, True, True]


def test_auto_is_on_except_where_flash_attention_was_asked_for():
    from grpo_fast.config import shares_prompts

    assert load_config("tiny").train.share_prompts == "auto"
    assert shares_prompts(load_config("tiny")) is True
    fa2 = load_config("tiny", overrides=["model.attn_implementation=flash_attention_2"], check_device=False)
    assert shares_prompts(fa2) is False
    assert shares_prompts(load_config("tiny", overrides=["train.share_prompts=false"])) is False


def test_eager_attention_gives_the_unshared_gradients_too(attention_path):
    """The shared path wraps either base implementation; under eager it matches eager unshared."""
    tok, seqs = _rollout(seed=2)
    model = tiny.build_model(tok, seed=0)
    model.set_attn_implementation("eager")
    unshared = _step(model, seqs, tok.pad_token_id, 5, packing=False)
    shared = _step(model, seqs, tok.pad_token_id, 5, packing=False, share_prompts=True)
    _assert_same(unshared, shared)


def test_calls_without_a_layout_run_the_base_attention_unchanged():
    """Generation and evaluation run the same model after ``enable``: a left-padded batch (a 2-D
    mask, as ``generate`` passes it) gives bit-identical logits before and after."""
    from grpo_fast.policy import shared_attention

    tok, _ = _rollout()
    model = tiny.build_model(tok, seed=0).eval()
    batch = tok(["12+34=", "7+8="], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        before = model(**batch).logits
        shared_attention.enable(model)
        assert model.config._attn_implementation == "grpo_fast_shared+sdpa"
        shared_attention.enable(model)  # idempotent
        after = model(**batch).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("dense_max_width", [None, 0], ids=["default", "gathered"])
def test_attention_work_is_at_most_the_unshared_layouts(monkeypatch, dense_max_width):
    """Long responses after a short prompt: a dense mask over ``[prompt, r_1 … r_4]`` scores
    (4 + 4·12)² = 2,704 query-key pairs per head where the unshared rows score 4 · 16² = 1,024; the
    gathers score 4² + 4 · 12 · 16 = 784 (counted over every SDPA call of a forward). The dense mask
    is for short rows only: this row of 52 tokens takes it under ``DENSE_MAX_WIDTH`` = 128."""
    from grpo_fast.policy import shared_attention

    if dense_max_width is not None:
        monkeypatch.setattr(shared_attention, "DENSE_MAX_WIDTH", dense_max_width)
    from grpo_fast.policy.batch import Sequence

    tok, _ = _rollout()
    model = tiny.build_model(tok, seed=0)
    g = torch.Generator().manual_seed(0)
    seqs = [
        Sequence([5, 6, 7, 8, *torch.randint(3, 15, (12,), generator=g).tolist()], 4, 1.0 - i / 2, 0.1)
        for i in range(4)
    ]  # fmt: skip
    real = torch.nn.functional.scaled_dot_product_attention
    pairs = []

    def counting(q, k, v, *a, **kw):
        pairs.append(q.shape[0] * q.shape[-2] * k.shape[-2])
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    per_layer = {}
    for share in (False, True):
        pairs.clear()
        mb = make_microbatches(seqs, 4, tok.pad_token_id, packing=False, share_prompts=share)[0]
        PolicyLoss(model, autocast=None, backend="torch_chunked")(mb, LossOptions(), 1.0)
        per_layer[share] = sum(pairs) // model.config.num_hidden_layers
    gathered = 4 * 4 + 4 * 12 * 16
    assert per_layer == {False: 4 * 16 * 16, True: 52 * 52 if dense_max_width is None else gathered}


def test_a_lora_adapter_gets_the_unshared_gradients(attention_path):
    """Under ``model.lora`` (a peft model around the base) the shared path is taken and gives the
    adapter the unshared layout's gradients."""
    from grpo_fast.policy.lora import apply_lora

    tok, seqs = _rollout(seed=3)
    lora = load_config("tiny", overrides=["model.lora.r=4"]).model.lora
    model = apply_lora(tiny.build_model(tok, seed=0), lora, "builtin:tiny")
    with torch.no_grad():  # a non-zero B, so that every adapter weight gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    unshared = _step(model, seqs, tok.pad_token_id, GROUP, packing=False)
    shared = _step(model, seqs, tok.pad_token_id, GROUP, packing=False, share_prompts=True)
    assert shared[2] and all("lora_" in name for name in shared[2])
    _assert_same(unshared, shared)


def test_a_model_outside_the_attention_interface_is_refused_in_one_line():
    """StableLM (transformers 5.24) picks its attention without the interface: the shared forward
    could not plug in, so ``enable`` refuses it rather than run the base under the placeholder."""
    from transformers import StableLmConfig, StableLmForCausalLM

    from grpo_fast.policy import shared_attention

    model = StableLmForCausalLM(
        StableLmConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2)
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"StableLmForCausalLM does not dispatch its attention .*train\.share_prompts=false"
    ):
        shared_attention.enable(model)


def test_layers_that_drop_the_layout_fail_loudly(monkeypatch):
    """A decoder layer that does not pass its keyword arguments on (Nemotron's in 5.24) would run
    the base attention under the all-True placeholder, every token seeing the whole row: the
    forward then stops with a ConfigError instead of a wrong loss. Planted: the first layer drops
    the layout."""
    tok, seqs = _rollout()
    model = tiny.build_model(tok, seed=0)
    layer = model.model.layers[0]
    real = type(layer).forward

    def dropping(self, *a, **k):
        k.pop("shared_prompt_layout", None)
        return real(self, *a, **k)

    monkeypatch.setattr(layer, "forward", dropping.__get__(layer))
    mb = make_microbatches(seqs, GROUP, tok.pad_token_id, packing=False, share_prompts=True)[0]
    with pytest.raises(ConfigError, match=r"took the shared layout in 2 of 3 layers"):
        PolicyLoss(model, autocast=None, backend="torch_chunked")(mb, LossOptions(), 1.0)
