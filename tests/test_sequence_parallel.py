"""``train.sequence_parallel`` (Ulysses): the N ranks of an sp group train one batch, each holding
1/N of every sequence's tokens (grpo_fast/policy/sequence_parallel.py, policy/ulysses.py).

In one process: a microbatch's slices hold every token and label exactly once, at the position
that predicts it (padded, packed and shared-prompt rows, N = 2 and 3); the shared-prompt layout
widened to the padded rows attends as before; calls without a shard run the attention unchanged;
what cannot work is refused in one line.

On 2 gloo ranks (``sequence_parallel=2``): the all-to-all puts heads and tokens where they belong
and back; the sharded loss, per-response log-probs and every gradient are the unsharded ones
(float64 reference, the eager fp32 error budget) in each layout, with GSPO off-policy, the
top-entropy quantile, gradient checkpointing, the eager kernel backend and eager attention; an
optimizer step under DDP and FSDP is one rank's (and on 4 ranks, dp 2 × sp 2); the training loop
trains each step exactly as one rank does; per-rank activation memory for a long sequence is at most
0.6× one rank's (measured).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.ranks import join_cpu_ranks, start_ranks

from grpo_fast import dist
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.dist import Axis
from grpo_fast.errors import ConfigError
from grpo_fast.policy import sequence_parallel, shared_attention, ulysses
from grpo_fast.policy.batch import Sequence, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.task import tiny
from grpo_fast.testing import assert_close_to_reference

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "padded": dict(packing=False),
    "packed": dict(packing=True),
    "shared": dict(packing=False, share_prompts=True),
    "shared_packed": dict(packing=True, share_prompts=True),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sequences(seed: int = 0) -> list[Sequence]:
    """3 prompts × 3 responses of 1-8 tokens, and one 11-token prompt with a 2-token response (a
    row in which the first half predicts no label: a rank with no response token)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    out = []
    for _ in range(3):
        prompt = torch.randint(3, 15, (rand(2, 7),), generator=g).tolist()
        for _ in range(3):
            response = [*torch.randint(3, 15, (rand(0, 8),), generator=g).tolist(), 1]
            adv = float(torch.randn(1, generator=g))
            out.append(Sequence(prompt + response, len(prompt), adv, 0.05))
    prompt = torch.randint(3, 15, (11,), generator=g).tolist()
    out.append(Sequence([*prompt, 7, 1], 11, 0.7, 0.05))
    return out


def _microbatches(layout: str, seed: int = 0, micro_batch_size: int = 4):
    return make_microbatches(_sequences(seed), micro_batch_size, pad_id=0, **LAYOUTS[layout])


def _token_records(mb, rows_of=None) -> list[tuple]:
    """``(flat predicting position, label, advantage, weight, sequence id, response index)`` of each
    label, in the microbatch's order; ``rows_of``: ``(width, lo, L)`` of a slice, to map its local
    positions back to the whole row's."""
    index = mb.select_index
    if rows_of is not None:
        s, lo, length = rows_of
        index = (index // s) * length + lo + index % s
    fields = (index, mb.labels, mb.advantages, mb.loss_weights, mb.sequence_ids, mb.response_index)
    return list(zip(*(t.tolist() for t in fields)))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_slices_hold_every_token_and_label_once(layout, size):
    """Rank r holds columns [r·L'/N, (r+1)·L'/N) of the rows padded to L' (a multiple of N): the
    slices side by side are the row (positions too: RoPE sees the whole row's), and each label sits
    on the rank of the position that predicts it, with its per-token fields, in the microbatch's
    order (a subsequence of it on every rank; all ranks together: every label once)."""
    for mb in _microbatches(layout):
        rows, length = mb.input_ids.shape
        parts = [sequence_parallel.shard(mb, Axis(r, size)) for r in range(size)]
        width = sum(p.input_ids.shape[1] for p in parts)
        assert width % size == 0 and length <= width < length + size
        assert all(p.input_ids.shape == (rows, width // size) for p in parts)
        ids = torch.cat([p.input_ids for p in parts], dim=1)
        assert torch.equal(ids[:, :length], mb.input_ids)
        positions = torch.cat([p.position_ids for p in parts], dim=1)[:, :length]
        full = mb.position_ids if mb.position_ids is not None else torch.arange(length).expand(rows, length)
        assert torch.equal(positions, full)
        whole = _token_records(mb)
        s = width // size
        found = []
        for r, p in enumerate(parts):
            local = _token_records(p, (s, r * s, length))
            assert all(r * s <= rec[0] % length < (r + 1) * s for rec in local)
            it = iter(whole)
            assert all(rec in it for rec in local), f"rank {r}: out of the microbatch's order"
            found += local
            assert p.sp.width == width and p.sp.num_sequences == int(mb.sequence_ids.max()) + 1
        assert sorted(found) == sorted(whole)


def test_the_mesh_axes_of_a_rank():
    """Rank 3 of 4 with sp groups of 2 (ranks 2-3 one group): dp rank 1 of 2, sp rank 1 of 2, and
    on the rollout side (``ranks``) rank 3 of 4 over the default group: every rank generates its
    own share of the prompts, the sp group then trains them together."""
    world = dist.DistInfo(rank=3, world_size=4, sp_size=2)
    assert (world.dp.rank, world.dp.size, world.sp.rank, world.sp.size) == (1, 2, 1, 2)
    assert (world.ranks.rank, world.ranks.size, world.ranks.group, world.ranks.whole_world) == (
        3,
        4,
        None,
        True,
    )
    assert not world.dp.whole_world and not world.sp.whole_world  # their own groups, never the default
    assert dist.DistInfo(rank=1, world_size=2).ranks == dist.DistInfo(rank=1, world_size=2).dp


def test_a_rank_may_hold_no_label():
    """The 11-token prompt with a 2-token response: its row's first half predicts nothing."""
    seqs = _sequences()[-1:]
    mb = make_microbatches(seqs, 1, pad_id=0, packing=False)[0]
    first, second = (sequence_parallel.shard(mb, Axis(r, 2)) for r in range(2))
    assert first.labels.numel() == 0 and first.label_bounds is None
    assert second.labels.tolist() == [7, 1]


@pytest.mark.parametrize("packing", [False, True], ids=["rows", "one-row"])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "gathered"])
def test_the_widened_shared_layout_attends_as_before(monkeypatch, packing, dense):
    """The shared-prompt layout moved to the padded rows (every flat index to the new row stride; a
    dense mask grown with the padding attending to itself): attention over the padded rows gives,
    at the old tokens, what the old layout gave, and finite values at the padding."""
    monkeypatch.setattr(shared_attention, "DENSE_MAX_WIDTH", 10**9 if dense else 0)
    for mb in _microbatches("shared", micro_batch_size=5) if not packing else _microbatches("shared_packed"):
        rows, length = mb.input_ids.shape
        width = length + 3
        wide = sequence_parallel._widened(mb.shared, rows, length, width)
        g = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(rows, h, width, 8, generator=g) for h in (4, 2, 2))
        out_wide = shared_attention.attention(q, k, v, wide)  # [b, L', h, d]
        out = shared_attention.attention(q[:, :, :length], k[:, :, :length], v[:, :, :length], mb.shared)
        torch.testing.assert_close(out_wide[:, :length], out, rtol=1e-6, atol=1e-6)
        assert torch.isfinite(out_wide).all()


def test_what_cannot_work_is_refused_in_one_line():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)  # 4 heads, 2 KV heads
    with pytest.raises(
        ConfigError,
        match=r"^train\.sequence_parallel=3: the model's 4 attention heads must divide by 3, .*: one of 1, 2, 4$",
    ):
        ulysses.check_model(model, 3)
    ulysses.check_model(model, 2)
    ulysses.check_model(model, 4)  # 4 query heads, one each; the 2 key/value heads repeated
    assert [n for n in range(1, 13) if ulysses.fits_heads(12, 2, n)] == [1, 2, 4, 6, 12]  # Qwen2.5-1.5B
    eager = tiny.build_model(tok, seed=0)
    eager.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match=r"attention 'flash_attention_2' is not one it can wrap"):
        ulysses.check_model(eager, 2)
    outside = tiny.build_model(tok, seed=0)  # a class that does not dispatch through the interface
    outside.__class__ = type("Legacy", (type(outside),), {"_supports_attention_backend": False})
    with pytest.raises(ConfigError, match=r"Legacy does not dispatch its attention through transformers'"):
        ulysses.check_model(outside, 2)
    with pytest.raises(ConfigError, match=r"runs Ulysses attention around sdpa or eager"):
        load_config(
            "tiny", overrides=["train.sequence_parallel=2", "model.attn_implementation=flash_attention_2"]
        )
    shard = sequence_parallel.SequenceShard(0, 2, None, 4, "causal", used=2)
    with pytest.raises(ConfigError, match=r"took the sequence shard in 2 of 3 layers"):
        ulysses.check_used(model, shard)


def test_a_run_without_enough_ranks_stops_in_one_line_and_writes_nothing(tmp_path):
    """``train.sequence_parallel=2`` in a plain process (no torchrun): exit 2, one line naming the
    key, no traceback, the output folder not created."""
    out = tmp_path / "never"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_fast.train",
            "--preset",
            "tiny",
            "train.sequence_parallel=2",
            f"output_dir={out}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "train.sequence_parallel=2 splits each sequence over 2 ranks" in lines[0]
    assert "(this run has 1)" in lines[0]
    assert not out.exists()


def test_calls_without_a_shard_run_the_inner_attention_unchanged():
    """Generation and evaluation run the same model after ``enable``: a left-padded batch (a 2-D
    mask, as ``generate`` passes it) gives bit-identical logits before and after."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0).eval()
    batch = tok(["12+34=", "7+8="], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        before = model(**batch).logits
        ulysses.enable(model, 2)
        assert model.config._attn_implementation == "grpo_fast_sp+grpo_fast_shared+sdpa"
        ulysses.enable(model, 2)  # idempotent
        shared_attention.enable(model)  # the shared-prompt path sees itself inside
        assert model.config._attn_implementation == "grpo_fast_sp+grpo_fast_shared+sdpa"
        after = model(**batch).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Two ranks: the all-to-all, and the loss and gradients of every layout against one rank
# ----------------------------------------------------------------------------------------------

GSPO = dict(importance_sampling_level="sequence", clip_low=0.02, clip_high=0.03)
# name -> layout, loss options, gradient checkpointing, kernel backend, off-policy π_old, attention
CASES = {
    "padded": ("padded", {}, False, "torch_chunked", False, "sdpa"),
    "packed": ("packed", {}, False, "torch_chunked", False, "sdpa"),
    "shared-dense": ("shared", {}, False, "torch_chunked", False, "sdpa"),
    "shared-gathered": ("shared", {}, False, "torch_chunked", False, "sdpa"),
    "gspo-off-policy": ("padded", GSPO, False, "torch_chunked", True, "sdpa"),
    "top-entropy-packed": ("packed", dict(top_entropy_quantile=0.3), False, "torch_chunked", False, "sdpa"),
    "checkpointed-gspo-shared": ("shared_packed", GSPO, True, "torch_chunked", True, "sdpa"),
    "eager-backend-gspo": ("padded", GSPO, False, "eager", True, "sdpa"),
    "eager-attention": ("packed", {}, False, "torch_chunked", False, "eager"),
    "one-kv-head-repeated": ("packed", GSPO, False, "torch_chunked", True, "sdpa"),  # 4 heads, 1 KV head
    "one-kv-head-causal": ("padded", {}, False, "torch_chunked", False, "sdpa"),
}


def _case_model(name: str, tok):
    """The tiny model (4 heads, 2 KV heads), or for the ``one-kv-head`` cases its variant with one
    key/value head (2 ranks: the head repeated, each rank a copy)."""
    if not name.startswith("one-kv-head"):
        return tiny.build_model(tok, seed=0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**tiny.build_model_config(tok).to_diff_dict(), "num_key_value_heads": 1})
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


TEMPERATURE = 0.8


def _case_microbatches(name: str, model, micro_batch_size: int = 4) -> list:
    layout, _, _, _, off_policy, _ = CASES[name]
    dense = shared_attention.DENSE_MAX_WIDTH
    shared_attention.DENSE_MAX_WIDTH = 0 if name == "shared-gathered" else 10**9
    try:
        mbs = _microbatches(layout, seed=3, micro_batch_size=micro_batch_size)
    finally:
        shared_attention.DENSE_MAX_WIDTH = dense
    if not off_policy:
        return mbs
    plain = PolicyLoss(model, autocast=None, backend="torch_chunked")
    out = []
    for i, mb in enumerate(mbs):  # π_old near π: GSPO's ratios near 1, some clipped
        with torch.no_grad():
            lp = plain(mb, LossOptions(), TEMPERATURE).logprobs
        noise = 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(i))
        out.append(dataclasses.replace(mb, old_logprobs=lp + noise))
    return out


def _run_case(name: str, model, mbs, sp: Axis | None, dtype=torch.float32) -> dict:
    """Loss, per-response log-prob and entropy sums, entropy thresholds and gradients of one
    accumulated pass over ``mbs`` (each sharded for ``sp`` when given)."""
    _, options, checkpointing, backend, _, attention = CASES[name]
    model = copy.deepcopy(model).to(dtype)
    model.set_attn_implementation(attention)
    if checkpointing:
        from grpo_fast.policy.model import enable_checkpointing

        enable_checkpointing(model)
        model.train()
    loss_fn = PolicyLoss(model, autocast=None, backend="eager" if dtype == torch.float64 else backend)
    n_resp = len(_sequences())
    loss = torch.zeros((), dtype=torch.float64)
    lp_sums, ent_sums = torch.zeros(n_resp, dtype=torch.float64), torch.zeros(n_resp, dtype=torch.float64)
    thresholds = []
    for mb in mbs:
        mb = sequence_parallel.shard(mb, sp) if sp is not None else mb
        out = loss_fn(mb, LossOptions(**options), TEMPERATURE)
        out.loss.backward()
        loss += out.loss.detach().double()
        lp_sums.index_add_(0, mb.response_index, out.logprobs.detach().double())
        ent_sums.index_add_(0, mb.response_index, out.entropy.detach().double())
        if out.entropy_threshold is not None:
            thresholds.append(float(out.entropy_threshold))
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
    return {"loss": loss, "logprobs": lp_sums, "entropy": ent_sums, "thresholds": thresholds, "grads": grads}


def _eager_noise(name: str, model, mbs, ref: dict) -> dict:
    """The unsharded fp32 run's result whose error sets the budget: per entry, the draw farthest
    from the float64 reference among the same batch in microbatches of 4 (the sharded run's), 2 and
    3 (on-policy cases; an off-policy case's π_old noise is drawn per microbatch, so it has the one
    composition). One composition's error is one draw of fp32's rounding, a poor estimate where a
    single entry cancels heavily: layer 0's input_layernorm gradient entry 121 ("eager-attention",
    value 5.7e-4, relative error ~1e-5) is off by 5.1e-9, 5.5e-9 and 7.7e-9 in the three
    compositions and by 1.09e-8 sharded (Intel Xeon with AMX, 2026-12-06; 2.1x the first draw alone).
    The loss, log-probs and entropies are per-response sums, the same in every composition; the
    thresholds are each microbatch's, so the first composition's."""
    draws = [_run_case(name, model, mbs, None)]
    if not CASES[name][4]:
        draws += [_run_case(name, model, _case_microbatches(name, model, size), None) for size in (2, 3)]

    def noisiest(ref_t, ts):
        errs = torch.stack([(t - ref_t).abs() for t in ts])
        return torch.stack(ts).gather(0, errs.argmax(0, keepdim=True)).squeeze(0)

    out = dict(draws[0])
    for key in ("loss", "logprobs", "entropy"):
        out[key] = noisiest(ref[key], [d[key] for d in draws])
    out["grads"] = {n: noisiest(ref["grads"][n], [d["grads"][n] for d in draws]) for n in ref["grads"]}
    return out


def _all_reduced(result: dict) -> dict:
    out = dict(result)
    for key in ("loss", "logprobs", "entropy"):
        t = result[key].clone()
        torch.distributed.all_reduce(t)
        out[key] = t
    grads = {}
    for n, g in result["grads"].items():
        g = g.clone()
        torch.distributed.all_reduce(g)
        grads[n] = g
    out["grads"] = grads
    return out


def _layout_worker(rank: int, group) -> dict:
    """``sequence_to_heads`` then ``heads_to_sequence`` on 2 ranks: what each rank gets, and the
    round trip; the backward of a weighted sum (each input's gradient: its weight, sent back)."""
    b, h, s, d = 2, 4, 3, 5
    tokens = torch.arange(2 * s).float()  # whole-row token index
    # value = 1000·row + 100·head + token + 0.01·feature, this rank's tokens [rank·s, (rank+1)·s)
    base = (1000 * torch.arange(b)[:, None, None, None] + 100 * torch.arange(h)[None, :, None, None]).float()
    x = base + tokens[rank * s : (rank + 1) * s][None, None, :, None] + 0.01 * torch.arange(d).float()
    x.requires_grad_(True)
    (full,) = ulysses.sequence_to_heads([x], 2, group)
    back = ulysses.heads_to_sequence(full.transpose(1, 2), 2, group)  # [b, s, h, d]
    weight = torch.randn(full.shape, generator=torch.Generator().manual_seed(9))  # same on both ranks
    (full * weight).sum().backward()
    return {"full": full.detach(), "back": back.transpose(1, 2).detach(), "x": x.detach(), "grad": x.grad}


def _importance_weights_worker(sp: Axis) -> list[tuple]:
    """The sampler correction's sequence-level weights on this rank's slice of a padded microbatch
    (random trainer and sampler log-probs): ``(response, whole microbatch's weight, this rank's)``."""
    from grpo_fast.algo.sampler_correction import raw_importance_weights

    mb = _microbatches("padded", seed=4, micro_batch_size=10)[0]
    g = torch.Generator().manual_seed(5)
    old, sampler = (0.1 * torch.randn(mb.labels.shape, generator=g) - 1.0 for _ in range(2))
    mb = dataclasses.replace(mb, old_logprobs=old, sampler_logprobs=sampler)
    whole = raw_importance_weights(old, sampler, mb.sequence_ids, level="sequence")
    mine = sequence_parallel.shard(mb, sp)
    local = raw_importance_weights(
        mine.old_logprobs, mine.sampler_logprobs, mine.sequence_ids, level="sequence",
        across=sequence_parallel.across(mine),
    )  # fmt: skip
    by_response = dict(zip(mb.response_index.tolist(), whole.tolist()))
    return [(i, by_response[i], w) for i, w in zip(mine.response_index.tolist(), local.tolist())]


def _sp_worker(rank, world_size, port, out_path):
    world = join_cpu_ranks(rank, world_size, port, sequence_parallel=2)
    tok = tiny.build_tokenizer()
    results = {"layout": dist.all_gather_objects(_layout_worker(rank, world.sp.group))}
    results["is_weights"] = dist.all_gather_objects(_importance_weights_worker(world.sp))
    for name in CASES:
        model = _case_model(name, tok)
        mbs = _case_microbatches(name, model)
        sharded = _all_reduced(_run_case(name, model, mbs, world.sp))
        if rank == 0:
            ref = _run_case(name, model, mbs, None, torch.float64)
            results[name] = {"actual": sharded, "eager": _eager_noise(name, model, mbs, ref), "ref64": ref}
        dist.barrier()
    if rank == 0:
        torch.save(results, out_path)
    dist.shutdown()


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "rank0.pt"
    start_ranks(_sp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_the_all_to_all_swaps_tokens_for_heads_and_back(sp_results):
    """Rank r gets heads [2r, 2r+2) of every token (in row order), the way back restores each
    rank's tokens, and the backward hands each input its own gradient (the exchange reversed)."""
    for rank, got in enumerate(sp_results["layout"]):
        full = got["full"]  # [2, 2, 6, 5]
        heads = torch.arange(2 * rank, 2 * rank + 2).float()
        want = (
            1000 * torch.arange(2)[:, None, None, None]
            + 100 * heads[None, :, None, None]
            + torch.arange(6).float()[None, None, :, None]
            + 0.01 * torch.arange(5).float()
        )
        torch.testing.assert_close(full, want, rtol=0, atol=0)
        torch.testing.assert_close(got["back"], got["x"], rtol=0, atol=0)
    weight = torch.randn(2, 2, 6, 5, generator=torch.Generator().manual_seed(9))
    for rank, got in enumerate(sp_results["layout"]):  # rank r's tokens, each head group's weight
        want = torch.cat([weight[:, :, 3 * rank : 3 * rank + 3]] * 2, dim=1)
        torch.testing.assert_close(got["grad"], want, rtol=0, atol=0)


@pytest.mark.slow
def test_the_sequence_level_importance_weight_is_the_whole_responses(sp_results):
    """``rollout.is_level=sequence``: ρ = exp(Σ_t∈response Δ_t), the sum over both ranks' tokens
    of the response: each token's weight is the one computed on the whole microbatch (fp64)."""
    first, second = sp_results["is_weights"]
    split = {i for i, _, _ in first} & {i for i, _, _ in second}
    assert len(split) >= 3  # responses with tokens on both ranks
    for _, whole, local in first + second:
        assert local == pytest.approx(whole, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_sharded_loss_logprobs_and_gradients_are_one_ranks(sp_results, name):
    """Against the float64 reference, within twice the unsharded fp32 error (plus two ulps; the
    error of the noisiest of three microbatch compositions, ``_eager_noise``): the
    summed loss, every response's summed log-probs and entropies, and every parameter's gradient
    (summed over the two ranks: each is a partial sum over its tokens); the top-entropy threshold
    is the whole microbatch's on both ranks."""
    r = sp_results[name]
    act, eager, ref = r["actual"], r["eager"], r["ref64"]
    scale = float(ref["logprobs"].abs().sum() * 0.05 * 4)  # Σ|w·ℓ| bound: w = 0.05, |A·ratio| < 4
    assert_close_to_reference(act["loss"], ref["loss"], eager["loss"], name="loss", scale=scale)
    assert_close_to_reference(act["logprobs"], ref["logprobs"], eager["logprobs"], name="logprobs")
    assert_close_to_reference(act["entropy"], ref["entropy"], eager["entropy"], name="entropy")
    assert act["thresholds"] == pytest.approx(eager["thresholds"], rel=1e-6)
    assert set(act["grads"]) == set(ref["grads"])
    for n in ref["grads"]:
        assert_close_to_reference(
            act["grads"][n], ref["grads"][n], eager["grads"][n], name=n, eager_error_over="tensor"
        )
    assert max(g.abs().max() for g in ref["grads"].values()) > 1e-3  # a real gradient


# ----------------------------------------------------------------------------------------------
# An optimizer step under DDP and FSDP over dp × sp ranks, and the loop
# ----------------------------------------------------------------------------------------------

PROMPTS, GROUP = 4, 4


def _dp_share(cfg, tok, world: dist.DistInfo):
    """This dp rank's share of a fixed rollout (whole groups), with the batch's normalizers."""
    from grpo_fast.policy.batch import assign_loss_weights
    from grpo_fast.rollout.trajectory import Trajectory

    g = torch.Generator().manual_seed(123)
    rand_len = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    prompts = [torch.randint(3, 15, (rand_len(3, 7),), generator=g).tolist() for _ in range(PROMPTS)]
    responses = [
        [*torch.randint(3, 15, (rand_len(1, 9),), generator=g).tolist(), 1] for _ in range(PROMPTS * GROUP)
    ]
    adv = torch.randn(PROMPTS * GROUP, generator=g)
    per = PROMPTS // world.dp.size
    lo, hi = world.dp.rank * per, (world.dp.rank + 1) * per
    seqs = [
        Trajectory(prompts[i // GROUP], responses[i], advantage=float(adv[i]))
        for i in range(lo * GROUP, hi * GROUP)
    ]
    n_seq, n_tok = dist.all_reduce_sum(
        [len(seqs), sum(t.num_sampled for t in seqs)], torch.device("cpu"), axis=world.dp
    )
    assign_loss_weights(
        seqs,
        length_norm="token_mean",
        max_length=cfg.rollout.max_tokens,
        num_sequences=int(n_seq),
        num_tokens=n_tok,
    )
    return make_microbatches(seqs, 3, tok.pad_token_id, packing=False)


def _optimizer_step(cfg, tok, world: dist.DistInfo, mode: str) -> dict:
    """One AdamW step of the tiny model on this rank's microbatches (sharded for its sp rank) under
    ``mode`` (``ddp``, ``fsdp``, ``one``: no wrapper, one rank); the loss over every rank, the
    gradient norm and the full weights after."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from grpo_fast.loop.optim import build_optimizer
    from grpo_fast.loop.optimization import optimize_on_rollout
    from grpo_fast.loop.state import Trainer
    from grpo_fast.policy import fsdp

    model = tiny.build_model(tok, seed=0)
    if world.sp.enabled:
        ulysses.enable(model, world.sp.size)
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    if mode == "fsdp":
        fsdp.shard_policy(policy, None, torch.device("cpu"), world.world_size)
    elif mode == "ddp":
        policy = DDP(policy)
    mbs = [sequence_parallel.shard(mb, world.sp) for mb in _dp_share(cfg, tok, world)]
    (missing,) = fsdp.padding_count([len(mbs)], torch.device("cpu"), fsdp.is_sharded(policy))
    fillers = fsdp.fillers(missing, mbs[0], tok.pad_token_id, torch.device("cpu"))
    optimizer = build_optimizer(cfg, list(model.parameters()))
    grads = {}
    real_step = optimizer.step

    def step_keeping_gradients():  # the clipped gradients the step reads, whole (FSDP: gathered)
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()
        real_step()

    optimizer.step = step_keeping_gradients
    trainer = Trainer(policy, optimizer, list(model.parameters()), cfg, world)
    stats = optimize_on_rollout(trainer, mbs, options=LossOptions(), temperature=1.0, fillers=fillers)
    loss = float(stats.sums["loss"])
    if world.enabled:  # every rank's part
        (loss,) = dist.all_reduce_sum([loss], torch.device("cpu"))
    weights = (
        fsdp.full_state_dict(model)
        if mode == "fsdp"
        else {k: v.clone() for k, v in model.state_dict().items()}
    )
    return {"loss": loss, "grad_norm": stats.grad_norm, "weights": weights, "grads": grads}


def _step_worker(rank, world_size, port, out_path):
    join_cpu_ranks(rank, world_size, port)
    cfg = load_config("tiny", overrides=["train.lr=1e-4"])
    results = {}
    for sp in (2, 4) if world_size == 4 else (2,):  # the same ranks as dp 2 × sp 2, then one sp group of 4
        world = dist.init("cpu", sp)
        for mode in ("ddp", "fsdp"):
            results[mode, sp] = _optimizer_step(cfg, tiny.build_tokenizer(), world, mode)
    if rank == 0:
        results["one"] = _optimizer_step(cfg, tiny.build_tokenizer(), dist.DistInfo(), "one")
        torch.save(results, out_path)
    dist.barrier()
    dist.shutdown()


def _step_results(tmp_path, world_size: int) -> dict:
    out = tmp_path / f"steps_{world_size}.pt"
    start_ranks(_step_worker, args=(world_size, _free_port(), str(out)), nprocs=world_size, join=True)
    return torch.load(out, weights_only=False)


def _assert_one_ranks_step(results: dict) -> None:
    one = results.pop("one")
    start = tiny.build_model(tiny.build_tokenizer(), seed=0).state_dict()
    assert max((one["weights"][k] - start[k]).abs().max().item() for k in start) > 5e-5  # it moved
    names = set(one["grads"])
    assert names == set(start) - {"lm_head.weight"}  # tied: the lm_head's gradient is the embedding's
    for mode, got in results.items():
        assert got["loss"] == pytest.approx(one["loss"], rel=1e-5), mode
        assert got["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), mode
        assert set(got["grads"]) == names, mode
        for n in names:  # each gradient one rank's to fp32 rounding of its largest entry
            g, ref = got["grads"][n], one["grads"][n]
            assert (g - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), (mode, n)
        # AdamW's first step is lr·g/(|g| + ε): where |g| is near ε = 1e-8 it turns a gradient's
        # last-bit rounding into a visible weight change, so weights are compared where |g| ≥ 1e-6
        # (100 ε: there a relative rounding δ of g moves the weight by at most lr·δ/100)
        for k in start:
            steady = one["grads"][k if k in names else "model.embed_tokens.weight"].abs() >= 1e-6
            worst = (got["weights"][k] - one["weights"][k])[steady].abs().max().item()
            assert worst <= 1e-7, (mode, k, worst)


@pytest.mark.slow
def test_an_optimizer_step_on_an_sp_group_is_one_ranks(tmp_path):
    """2 ranks, one sp group (dp 1): each holds half of every sequence; DDP's and FSDP's average
    over the 2 ranks times the loop's world-size scale is the sum of their partial gradients, so
    the loss, the gradient norm and the weights after one AdamW step are one rank's."""
    _assert_one_ranks_step(_step_results(tmp_path, 2))


@pytest.mark.slow
def test_dp_groups_of_sp_ranks_step_as_one_rank(tmp_path):
    """4 ranks, dp 2 × sp 2: each dp rank trains half the prompts, each of its sp ranks half of
    every sequence; and one sp group of 4, where the tiny model's 2 key/value heads are repeated (a
    copy a rank, rank r the one its query head reads): the step is one rank's on the whole batch,
    under DDP and FSDP."""
    results = _step_results(tmp_path, 4)
    assert set(results) == {"one", ("ddp", 2), ("fsdp", 2), ("ddp", 4), ("fsdp", 4)}
    _assert_one_ranks_step(results)


def _loop_worker(rank, world_size, port, root, more=()):
    """Rank 0 first runs the loop alone (no group yet: ``root/one``), then the 2 ranks run it with
    ``sequence_parallel=2`` (``root/sp``): one spawn for both runs."""
    import answer_oracle

    from grpo_fast.train import run

    answer_oracle.install_in_process(tiny.build_tokenizer())
    overrides = lambda out, sp: [f"output_dir={out}", "steps=2", "sft.steps=0", "eval_every=0",
                                 "checkpoint_every=0", "rollout.batch_size=32", "train.micro_batch_size=5",
                                 "logging.progress=false", f"train.sequence_parallel={sp}",
                                 "loss.length_norm=token_mean", *more]  # fmt: skip
    if rank == 0:  # one rank: the environment names no group (rank 1 waits to join it)
        run(load_config("tiny", overrides=overrides(Path(root) / "one", 1)))
    join_cpu_ranks(rank, world_size, port)
    dist._OWN_GROUP = False
    run(load_config("tiny", overrides=overrides(Path(root) / "sp", 2)))
    torch.distributed.destroy_process_group()


def _rows(folder: Path) -> list[dict]:
    return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "more, reward",
    [((), 0.5), (("rollout.max_tokens=1",), None),
     (("loss.advantage=gae", "critic.lr=0.05", "critic.trunk_coef=0.5"), 0.5)],
    ids=["informative", "all-skipped", "value-head"],
)  # fmt: skip
def test_the_loop_trains_each_step_as_one_rank_does(tmp_path, more, reward):
    """The tiny preset's loop with the answering policy of tests/answer_oracle.py (the same responses
    to the same prompts however they are split): on 2 ranks with ``sequence_parallel=2`` (each rank
    generates half the prompts, the group trains them all, each rank half of every sequence) every
    step has one rank's rewards, loss, gradient norm, entropy and skipped fraction, and the final
    weights are one rank's. ``all-skipped``: responses cut to one token (the right answer and its
    tenfold then agree), every group's rewards equal, all but the shortest response skipped.
    ``value-head``: ``loss.advantage=gae``, the head on each rank's half of the hidden states
    (half its value loss's gradient into the trunk): the value loss and head's gradient norm too."""
    from safetensors.torch import load_file

    start_ranks(_loop_worker, args=(2, _free_port(), str(tmp_path), more), nprocs=2, join=True)
    one, sp = _rows(tmp_path / "one"), _rows(tmp_path / "sp")
    assert [r["world_size"] for r in sp] == [2, 2]
    for a, b in zip(one, sp, strict=True):
        assert (b["train/reward_mean"], b["train/accuracy"]) == (a["train/reward_mean"], a["train/accuracy"])
        assert reward is None or a["train/reward_mean"] == reward
        assert reward is not None or a["train/skipped_fraction"] > 0.9
        keys = ["train/loss", "train/grad_norm", "train/entropy_mean", "train/response_length_mean"]
        keys += ["train/value_loss", "train/value_grad_norm"] if "train/value_loss" in a else []
        for key in keys:
            # whitened GAE advantages make the on-policy loss −Σ w·A cancel to ~1e-8 (fp32): there
            # an absolute bound, of the order of that cancellation
            near_zero = key == "train/loss" and "train/value_loss" in a
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6 if near_zero else None), key
        assert b["train/skipped_fraction"] == a["train/skipped_fraction"]
    w_one = load_file(tmp_path / "one" / "final" / "model.safetensors")
    w_sp = load_file(tmp_path / "sp" / "final" / "model.safetensors")
    assert max((w_sp[k] - w_one[k]).abs().max().item() for k in w_one) <= 1e-6


def _vllm_loop_worker(rank, world_size, port, root):
    """2 ranks, one process group: the loop with the fake vLLM engine as 2 data-parallel ranks
    (``root/sp1``), then with ``sequence_parallel=2`` (``root/sp2``)."""
    from test_rollout_vllm import FakeVLLMEngine

    from grpo_fast.train import run

    join_cpu_ranks(rank, world_size, port)
    dist._OWN_GROUP = False
    tok = tiny.build_tokenizer()
    for sp in (1, 2):
        overrides = [f"output_dir={Path(root) / f'sp{sp}'}", "steps=2", "sft.steps=0", "eval_every=0",
                     "checkpoint_every=0", "rollout.batch_size=32", "logging.progress=false",
                     "rollout.backend=vllm", "rollout.is_correction=true", "rollout.is_level=sequence",
                     "train.epochs_per_rollout_batch=2", "loss.importance_sampling_level=sequence",
                     "train.skip_zero_advantage=false", f"train.sequence_parallel={sp}"]  # fmt: skip
        run(
            load_config("tiny", overrides=overrides, check_device=False),
            engine=FakeVLLMEngine(tiny.build_model(tok, seed=0), tok),
        )
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_with_the_vllm_backend_it_trains_as_data_parallel_does(tmp_path):
    """``rollout.backend=vllm`` (tests/test_rollout_vllm.py's fake engine, one a rank, pushed after
    every step), the sequence-level sampler correction, two epochs (π_old from the trainer) and GSPO:
    2 ranks with ``sequence_parallel=2`` sample what 2 data-parallel ranks sample and train the same
    batch (each rank half of every sequence): the same rewards, loss and gradient norm, the probe's
    weight-sync gap as small."""
    start_ranks(_vllm_loop_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ddp, sp = _rows(tmp_path / "sp1"), _rows(tmp_path / "sp2")
    for a, b in zip(ddp, sp, strict=True):
        assert b["train/reward_mean"] == a["train/reward_mean"]
        for key in ("train/loss", "train/grad_norm", "train/entropy_mean", "train/clip_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert b["rollout/weight_sync_abs_diff"] < 1e-5


def _main_worker(rank, world_size, port, runs):
    """Rank ``rank`` of ``python -m grpo_fast.train`` as torchrun would start it, once for each
    argument list of ``runs`` in turn (one process group for all: ``main`` leaves it)."""
    from grpo_fast.train import main

    join_cpu_ranks(rank, world_size, port)
    dist._OWN_GROUP = False
    for args in runs:
        assert main(args) == 0, (rank, args)
    torch.distributed.destroy_process_group()


def _main_args(out: Path, *overrides: str) -> list[str]:
    return ["--preset", "tiny", f"output_dir={out}", "steps=2", "sft.steps=0", "eval_every=0",
            "checkpoint_every=0", "logging.progress=false", "train.skip_zero_advantage=false",
            *overrides]  # fmt: skip


@pytest.mark.slow
def test_the_pipeline_with_sequence_parallel_trains_as_data_parallel_does(tmp_path):
    """``python -m grpo_fast.train --preset tiny train.sequence_parallel=2`` on 2 ranks (spawned as
    torchrun would start them; the launcher itself: tests/test_distributed.py) with the pipeline
    (``rollout.max_staleness=1``, the sampler's log-probs as π_old) samples what 2 data-parallel
    ranks at staleness 1 sample (each rank its own prompts and seed) and trains the same batch: the
    same rewards, and the loss and gradient norm of plain data parallelism (the lockstep outline's
    case is the in-process loop test above; both outlines run one step function,
    ``grpo_fast.loop.step``). Planted: the pipeline's step without the sp group's batch
    (``sp_group.share_batch``, ed0dfd1) → each sp rank trains its own half: another loss."""
    stale = ("rollout.max_staleness=1", "rollout.old_logprobs=sampler")
    runs = [
        _main_args(tmp_path / "ddp", *stale),
        _main_args(tmp_path / "sp", "train.sequence_parallel=2", *stale),
    ]
    start_ranks(_main_worker, args=(2, _free_port(), runs), nprocs=2, join=True)
    ddp, sp = _rows(tmp_path / "ddp"), _rows(tmp_path / "sp")
    assert [r["rollout/policy_lag"] for r in sp] == [0.0, 1.0]
    assert [r["world_size"] for r in ddp + sp] == [2] * 4
    for a, b in zip(ddp, sp, strict=True):
        assert b["train/reward_mean"] == a["train/reward_mean"]
        for key in ("train/loss", "train/grad_norm", "train/entropy_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


# ----------------------------------------------------------------------------------------------
# Memory: per-rank activations of a long sequence
# ----------------------------------------------------------------------------------------------

LONG = 2048  # tokens of the one sequence (64 prompt + 1,984 response)


def _memory_worker(rank, world_size, port, out_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_fast.obs.memory import tracked_peak_bytes

    world = join_cpu_ranks(rank, world_size, port, sequence_parallel=2)
    config = Qwen2Config(
        vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LONG, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    loss_fn = PolicyLoss(model, autocast=None, backend="torch_chunked")
    tokens = torch.randint(3, 1024, (LONG,), generator=torch.Generator().manual_seed(1)).tolist()
    mb = make_microbatches([Sequence(tokens, 64, 1.0, 1.0 / (LONG - 64))], 1, 0, packing=False)[0]
    step = lambda m: lambda: loss_fn(m, LossOptions(), 1.0).loss.backward()
    local = sequence_parallel.shard(mb, world.sp)
    peaks = {}
    for name, m in (("one rank", mb), ("sp rank", local)):
        step(m)()  # warm-up: the parameters' .grad exist, so the measured step adds to them in place
        peaks[name] = tracked_peak_bytes(step(m))
    gathered = dist.all_gather_objects(peaks)
    if rank == 0:
        torch.save(gathered, out_path)
    dist.shutdown()


@pytest.mark.slow
def test_a_rank_of_two_holds_at_most_0_6_of_the_activations_of_a_long_sequence(tmp_path):
    """One 2,048-token sequence, forward and backward (tracked allocations, each rank in its own
    process): an sp rank's peak is at most 0.6× the peak of the whole sequence on one rank (measured
    0.53-0.55: its half of every token's activations, and in attention its heads' full-length q, k,
    v, o, the same bytes)."""
    out = tmp_path / "memory.pt"
    start_ranks(_memory_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    for peaks in torch.load(out):
        assert peaks["sp rank"] <= 0.6 * peaks["one rank"], peaks
        assert peaks["one rank"] > 50 * 2**20  # activations, not noise: ≈ 100 MiB
