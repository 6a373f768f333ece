"""FSDP2 (``train.parallelism=fsdp``) on CPU with 2 gloo ranks: the same update as DDP from the
same start, half the bytes on each rank (and the planner's per-rank numbers against them), a
streamed weight push, sharded checkpoints that resume exactly (and on another number of
ranks), the final model in Hugging Face format; the config errors and the per-rank plan. (LoRA,
QLoRA and 8-bit AdamW under FSDP: tests/test_fsdp_lora.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch
from support.ranks import join_cpu_ranks, start_ranks

from grpo_fast import dist
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.loop.optimization import optimize_on_rollout
from grpo_fast.loop.state import Trainer
from grpo_fast.policy import fsdp
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.policy.model import enable_checkpointing
from grpo_fast.policy.value import ValueHead
from grpo_fast.rollout import Rollout
from grpo_fast.task import tiny
from grpo_fast.tools import plan

ROOT = Path(__file__).resolve().parents[1]
GROUP, PROMPTS = 4, 4  # 16 responses: 2 whole groups per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_microbatches(cfg, tok, rank: int, world_size: int, micro_batch: int, share_prompts: bool = False):
    """This rank's share of a fixed rollout (prompts, responses of mixed lengths, advantages),
    with the global length normalizers, in microbatches of ``micro_batch`` (each prompt once for
    its responses with ``share_prompts``)."""
    g = torch.Generator().manual_seed(123)
    rand_len = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    prompts = [torch.randint(3, 15, (rand_len(3, 7),), generator=g).tolist() for _ in range(PROMPTS)]
    responses = [
        [*torch.randint(3, 15, (rand_len(1, 5),), generator=g).tolist(), 1] for _ in range(PROMPTS * GROUP)
    ]
    adv = torch.randn(PROMPTS * GROUP, generator=g)
    per = PROMPTS // world_size
    lo, hi = rank * per, (rank + 1) * per
    mine = responses[lo * GROUP : hi * GROUP]
    lengths = [len(r) for r in mine]
    n_seq, n_tok = dist.all_reduce_sum([len(lengths), sum(lengths)], torch.device("cpu"))
    seqs = loss_trajectories(
        Rollout(prompts[lo:hi], mine),
        advantages=adv[lo * GROUP : hi * GROUP],
        length_norm=cfg.loss.length_norm,
        max_length=cfg.rollout.max_tokens,
        num_sequences=int(n_seq),
        num_tokens=n_tok,
    )
    return make_microbatches(seqs, micro_batch, tok.pad_token_id, packing=False, share_prompts=share_prompts)


def _train(cfg, tok, mbs, mode: str, world: dist.DistInfo, steps: int) -> dict:
    """``steps`` optimizer steps of the tiny model on ``mbs`` under ``mode`` (ddp, fsdp,
    fsdp_offload, fsdp_ckpt); the global loss of step 1, the grad norms, the full weights after
    step 1 and after the last step, and this rank's bytes (gradients as the first step applies them)."""
    model = tiny.build_model(tok, seed=0)
    if mode == "fsdp_ckpt":
        enable_checkpointing(model)
        model.train()
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    head = None
    if mode.endswith("_value"):  # loss.advantage=gae: a value head (random: a gradient into the trunk)
        head = ValueHead(model.config.hidden_size)
        torch.nn.init.normal_(head.proj.weight, std=0.5, generator=torch.Generator().manual_seed(7))
        policy.attach_value_head(head, trunk_coef=0.5, value_clip=0.2)
        g = torch.Generator().manual_seed(11 + world.rank)
        for mb in mbs:
            mb.returns = torch.randn(mb.labels.shape, generator=g)
            mb.old_values = 0.5 * mb.returns
    if mode.startswith("fsdp"):
        fsdp.shard_policy(policy, None, torch.device("cpu"), world.world_size, mode == "fsdp_offload")
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        policy = DDP(policy)
    params = list(model.parameters())
    value_params = list(head.parameters()) if head is not None else []
    optimizer = build_optimizer(cfg, params, value_params)
    seen = {}
    real_step = optimizer.step

    def recording_step(*a, **k):
        out = real_step(*a, **k)
        if "bytes" not in seen:  # after the first step: its gradients and the AdamW state
            seen["bytes"] = fsdp.local_bytes(model, optimizer)
        return out

    optimizer.step = recording_step
    (missing,) = fsdp.padding_count([len(mbs)], torch.device("cpu"), fsdp.is_sharded(policy))
    fillers = fsdp.fillers(missing, mbs[0], tok.pad_token_id, torch.device("cpu"))
    trainer = Trainer(policy, optimizer, params + value_params, cfg, world, value_head=head)
    offload = type(_group(policy).offload_policy).__name__ if fsdp.is_sharded(policy) else None
    out = {"missing": missing, "grad_norm": [], "offload": offload}
    for step in range(steps):
        stats = optimize_on_rollout(trainer, mbs, options=LossOptions(), temperature=1.0, fillers=fillers)
        out["grad_norm"].append(stats.grad_norm)
        if step == 0:
            (out["loss"],) = dist.all_reduce_sum([float(stats.sums["loss"])], torch.device("cpu"))
            out["after_1"] = _full_weights(model, policy)
    out["after_last"], out["bytes"] = _full_weights(model, policy), seen["bytes"]
    if head is not None:  # the head's weights, whole (a DTensor under FSDP)
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
        out["head"] = {k: full(v.detach()).clone() for k, v in head.state_dict().items()}
    return out


def _group(policy):
    return policy._get_fsdp_state()._fsdp_param_group


def _full_weights(model, policy) -> dict[str, torch.Tensor]:
    if fsdp.is_sharded(policy):
        return fsdp.full_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bf16_check(tok) -> dict:
    """Under ``train.mixed_precision=bf16``: the dtype a layer's weight has in its forward, the
    dtype gradients are reduced in, and the sharded gradient's."""
    model = tiny.build_model(tok, seed=0)
    policy = PolicyLoss(model, autocast=torch.bfloat16, backend="torch_chunked")
    fsdp.shard_policy(policy, torch.bfloat16, torch.device("cpu"), 2)
    seen = {}
    proj = fsdp.decoder_layers(model)[0].self_attn.q_proj
    proj.register_forward_pre_hook(lambda m, _: seen.update(forward=str(m.weight.dtype)))
    mb = make_microbatches(
        loss_trajectories(
            Rollout([[3, 4, 5]], [[6, 7, 1]]),
            advantages=torch.ones(1),
            length_norm="sequence_mean",
            max_length=8,
        ),
        1,
        tok.pad_token_id,
        packing=False,
    )[0]
    policy(mb, LossOptions(), 1.0).loss.backward()
    seen["reduce"] = str(fsdp.decoder_layers(model)[0]._get_fsdp_state()._fsdp_param_group._reduce_dtype)
    seen["grad"] = str(proj.weight.grad.dtype)
    return seen


def _step_worker(rank, world_size, port, out_path):
    join_cpu_ranks(rank, world_size, port)
    cfg = load_config("tiny", overrides=["train.lr=1e-4"])
    tok = tiny.build_tokenizer()
    world = dist.DistInfo(rank=rank, world_size=world_size)
    # rank 0 in 3 microbatches, rank 1 in 1: FSDP tops rank 1 up with 2 zero-weight fillers
    mbs, shared = (
        _rank_microbatches(cfg, tok, rank, world_size, micro_batch=3 if rank == 0 else 8, share_prompts=share)
        for share in (False, True)
    )
    results = {
        mode: _train(cfg, tok, shared if mode.endswith("_shared") else mbs, mode, world, steps=3)
        for mode in MODES
    }
    results["bytes_by_rank"] = dist.all_gather_objects({m: results[m]["bytes"] for m in MODES})
    results["missing_by_rank"] = dist.all_gather_objects(results["fsdp"]["missing"])
    results["bf16"] = _bf16_check(tok)
    if rank == 0:
        torch.save(results, out_path)
    dist.shutdown()


MODES = ("ddp", "fsdp", "fsdp_offload", "fsdp_ckpt", "ddp_shared", "fsdp_shared", "ddp_value", "fsdp_value")


@pytest.fixture(scope="module")
def step_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_steps") / "rank0.pt"
    start_ranks(_step_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "fsdp_offload", "fsdp_ckpt", "fsdp_shared", "fsdp_value"])
def test_fsdp_step_equals_ddp_from_the_same_start(step_results, mode):
    """The same start and the same microbatches (rank 1 has fewer: FSDP pads it with fillers):
    the same loss (≤ 1e-5 relative), the weights after one AdamW step at lr 1e-4 within fp32
    summation error (FSDP's reduce-scatter and sharded norm sum in another order), after three
    steps still within 1e-5; with CPU offload, with gradient checkpointing, and with shared prompts
    (``train.share_prompts``: each rank's prompts once for their responses; against DDP on the same
    shared microbatches), and with a value head in the loss module (``loss.advantage=gae``: half
    its value loss's gradient into the trunk; its weights too), alike."""
    twin = {"fsdp_shared": "ddp_shared", "fsdp_value": "ddp_value"}.get(mode, "ddp")
    ddp, got = step_results[twin], step_results[mode]
    assert step_results["missing_by_rank"] == [0, 2]  # rank 1 ran 2 fillers after its microbatch
    assert abs(got["loss"] - ddp["loss"]) <= 1e-5 * abs(ddp["loss"])
    assert got["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-5)
    start = tiny.build_model(tiny.build_tokenizer(), seed=0).state_dict()
    assert max((ddp["after_1"][k] - start[k]).abs().max().item() for k in start) > 5e-5  # it moved
    assert set(got["after_1"]) == set(ddp["after_1"])
    worst_1 = max((got["after_1"][k] - ddp["after_1"][k]).abs().max().item() for k in start)
    worst_3 = max((got["after_last"][k] - ddp["after_last"][k]).abs().max().item() for k in start)
    assert worst_1 <= 1e-6, worst_1
    assert worst_3 <= 1e-5, worst_3
    if mode == "fsdp_value":
        init = ValueHead(start["model.embed_tokens.weight"].shape[1]).proj.weight.detach()
        torch.nn.init.normal_(init, std=0.5, generator=torch.Generator().manual_seed(7))
        assert not torch.equal(got["head"]["proj.weight"], init)  # the head learned
        for k in ddp["head"]:
            torch.testing.assert_close(got["head"][k], ddp["head"][k], rtol=1e-5, atol=1e-6)
        assert got["after_last"].keys() == start.keys()  # the head is not in the model's weights


@pytest.mark.slow
def test_each_rank_holds_half_the_bytes_and_the_planner_says_so(step_results):
    """Measured local shards: each rank holds about half of DDP's weight, gradient and AdamW
    bytes, and the two halves add up to DDP's exactly; the planner's per-rank items for 2 ranks
    are within 2% of what a rank holds (the tiny model's dims split unevenly by a row)."""
    by_rank = step_results["bytes_by_rank"]
    whole = by_rank[0]["ddp"]
    cfg = load_config("tiny", overrides=["train.parallelism=fsdp", "train.mixed_precision=no"])
    model_cfg = tiny.build_model_config(tiny.build_tokenizer())
    mp_ = plan.plan_memory(cfg, plan.Arch.from_hf_config(model_cfg), 80 * plan.GB, world_size=2)
    planned = {"weights": mp_.weights, "grads": mp_.grads, "optimizer": mp_.optimizer}
    assert plan.Arch.from_hf_config(model_cfg).num_params * 4 == whole["weights"]
    for item in ("weights", "grads", "optimizer"):
        halves = [by_rank[r]["fsdp"][item] for r in (0, 1)]
        assert sum(halves) == whole[item], item
        assert all(0.45 * whole[item] <= h <= 0.55 * whole[item] for h in halves), (item, halves)
        assert all(abs(planned[item] - h) <= 0.02 * h for h in halves), (item, planned[item], halves)


@pytest.mark.slow
def test_fsdp_keys_reach_fully_shard(step_results):
    """``train.fsdp_cpu_offload`` is FSDP's CPUOffloadPolicy (on CPU it moves nothing, and the
    step is the same to the bit); under bf16 the layers compute with bf16 weights and reduce
    their gradients in fp32 into fp32 shards."""
    assert step_results["fsdp_offload"]["offload"] == "CPUOffloadPolicy"
    assert step_results["fsdp"]["offload"] == "OffloadPolicy"
    for k, v in step_results["fsdp"]["after_last"].items():
        assert torch.equal(v, step_results["fsdp_offload"]["after_last"][k]), k
    assert step_results["bf16"] == {
        "forward": "torch.bfloat16",
        "reduce": "torch.float32",
        "grad": "torch.float32",
    }


def _push_worker(rank, world_size, port, out_path):
    """A 6-layer tiny Qwen2 sharded over 2 ranks pushes its weights into the fake engine; the
    push's tracked peak, one layer's bytes, and whether the engine holds the full weights."""
    from test_rollout_vllm import FakeVLLMEngine
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_fast.obs.memory import tracked_peak_bytes
    from grpo_fast.rollout.vllm import VLLMBackend

    join_cpu_ranks(rank, world_size, port)
    tok = tiny.build_tokenizer()
    six = {"num_hidden_layers": 6, "layer_types": ["full_attention"] * 6}
    config = Qwen2Config(**{**tiny.build_model_config(tok).to_diff_dict(), **six})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = FakeVLLMEngine(model, tok)
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    fsdp.shard_policy(policy, None, torch.device("cpu"), world_size)
    backend = VLLMBackend(engine, tok, sleep_level=0)
    peak = tracked_peak_bytes(lambda: backend.update_weights(model, step=1))
    layer = sum(p.numel() * 4 for p in fsdp.decoder_layers(engine.model)[0].parameters())
    pushed = engine.model.state_dict()
    same = all(torch.equal(pushed[k], v) for k, v in expected.items())
    results = dist.all_gather_objects({"peak": peak, "layer": layer, "same": same})
    if rank == 0:
        torch.save(results, out_path)
    dist.shutdown()


@pytest.mark.slow
def test_the_push_streams_one_tensor_at_a_time(tmp_path):
    """The weight push from shards gathers each tensor as the engine takes it: on every rank its
    extra peak (tracked allocations) is below two decoder layers' worth of weights, where the
    whole model is six, and the engine then holds exactly the full weights."""
    out = tmp_path / "push.pt"
    start_ranks(_push_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    for r in torch.load(out, weights_only=False):
        assert r["same"]
        assert 0 < r["peak"] < 2 * r["layer"], r


def _loop_overrides(out: Path, *more: str) -> list[str]:
    return [
        f"output_dir={out}",
        "steps=4",
        "sft.steps=30",
        "eval_every=2",
        "checkpoint_every=3",
        "data.eval_subset_size=16",
        "logging.progress=false",
        "train.parallelism=fsdp",
        *more,
    ]


def _loop_worker(rank, world_size, port, root, more=()):
    """The tiny preset under FSDP on 2 ranks (with the overrides ``more``): a straight 4-step run;
    the same run stopped by a SIGTERM to rank 1 during step 2 (every rank stops after it, a
    sharded checkpoint of step 2 is written, copied to ``one_rank``); then resumed to step 4 in the
    same folder."""
    from grpo_fast import train
    from grpo_fast.errors import Preempted
    from grpo_fast.loop import step as loop_step

    join_cpu_ranks(rank, world_size, port)
    dist._OWN_GROUP = False  # one process group for the three runs (each run() would destroy it)
    root = Path(root)
    train.run(load_config("tiny", overrides=_loop_overrides(root / "straight", *more)))
    real = loop_step.end_of_step

    def sigterm_in_step_2(run_, step, *args):
        if step == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(run_, step, *args)

    loop_step.end_of_step = sigterm_in_step_2
    try:
        train.run(load_config("tiny", overrides=_loop_overrides(root / "stopped", *more)))
    except Preempted as stop:
        (root / f"preempted_{rank}.txt").write_text(str(stop))
    finally:
        loop_step.end_of_step = real
    if rank == 0:
        shutil.copytree(root / "stopped", root / "one_rank")  # the step-2 checkpoint, for 1 rank
    dist.barrier()
    train.run(load_config("tiny", overrides=_loop_overrides(root / "stopped", "resume=true", *more)))
    torch.distributed.destroy_process_group()


def _metrics_diff():
    spec = importlib.util.spec_from_file_location("metrics_diff", ROOT / "tools" / "metrics_diff.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_and_on_one_rank(tmp_path, capsys):
    """Under torch.distributed.checkpoint: a SIGTERM writes a sharded checkpoint (one shard file
    per rank, no weights on rank 0 alone), the resumed run's metrics equal the straight run's
    metric for metric, the final model is one Hugging Face folder that transformers loads and
    that holds the last checkpoint's weights; the 2-rank checkpoint loads on 1 rank, which says
    in one line that the sampling streams differ, and trains on. The FSDP test with a real signal
    (LoRA under FSDP resumes from its run's own checkpoint: tests/test_fsdp_lora.py). Planted:
    ``sharded_checkpoint.load`` without the optimizer's state → other step-4 metrics."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.policy import sharded_checkpoint
    from grpo_fast.train import run

    start_ranks(_loop_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        words = (tmp_path / f"preempted_{rank}.txt").read_text()
        assert words.startswith("SIGTERM during step 2: checkpoint ") and "step_000002" in words
    shards = sorted(p.name for p in (tmp_path / "one_rank/checkpoints/step_000002/dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list((tmp_path / "one_rank/checkpoints/step_000002").glob("*.safetensors"))
    diff = _metrics_diff()
    straight = diff.read_rows(tmp_path / "straight")
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4] and all(r["world_size"] == 2 for r in straight)
    assert diff.differences(straight, diff.read_rows(tmp_path / "stopped")) == []

    final = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "final")
    plain = tiny.build_model(tiny.build_tokenizer(), seed=1)
    sharded_checkpoint.load(
        tmp_path / "straight/checkpoints/step_000004", {"model": plain}, torch.optim.AdamW(plain.parameters()),
        {"optimizer_saved": False},
    )  # fmt: skip
    for k, v in plain.state_dict().items():
        assert torch.equal(final.state_dict()[k], v), k

    one = tmp_path / "one_rank"
    shutil.rmtree(one / "final", ignore_errors=True)
    capsys.readouterr()
    run(load_config("tiny", overrides=_loop_overrides(one, "resume=true", "steps=3", "eval_every=0")))
    said = capsys.readouterr().err  # the run's event lines go to stderr
    assert "resume on 1 rank(s) of a checkpoint written by 2" in said and "sampling streams differ" in said
    rows = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and rows[-1]["world_size"] == 1


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.fsdp_cpu_offload=true"], "train.fsdp_cpu_offload=true needs train.parallelism=fsdp"),
        (["train.parallelism=zero3"], "train.parallelism='zero3' is not one of: ddp, fsdp"),
    ],
)  # fmt: skip
def test_fsdp_config_errors_are_one_line(overrides, words, capsys):
    with pytest.raises(
        ConfigError, match="^" + words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        load_config("tiny", overrides=overrides)
    from grpo_fast.train import main

    assert main(["--preset", "tiny", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0]


def test_the_planner_prints_one_ranks_budget(capsys):
    """``grpo-fast plan --world-size N`` with fsdp: weights, gradients and optimizer state are
    1/N of DDP's, the gathered layers and root are listed, and with CPU offload the shards move
    to RAM and leave the GPU (Qwen2.5-7B on 8 × 80 GB, and on 2 × 24 GB with offload)."""
    seven_b = ["model.name_or_path=Qwen/Qwen2.5-7B"]
    one_card = load_config("h100", overrides=[*seven_b, "train.micro_batch_size=1"], check_device=False)
    ddp = plan.plan_memory(one_card, plan.KNOWN_ARCHS["Qwen/Qwen2.5-7B"], 1000 * plan.GB)  # what DDP holds
    assert (
        plan.main(
            [
                "--preset",
                "h100",
                "--gpu-mem-gb",
                "80",
                "--world-size",
                "8",
                "train.parallelism=fsdp",
                *seven_b,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "80.00 GB × 8 ranks, per rank:" in out and "gathered in flight" in out and "gathered root" in out
    for label, value in (
        ("weights (1/8 shard)", ddp.weights),
        ("optimizer state (1/8 shard)", ddp.optimizer),
    ):
        line = next(x for x in out.splitlines() if x.startswith(label))
        assert f"{value / 8 / plan.GB:.2f} GB" in line, line
    offload = ["train.optimizer=adamw", "train.fsdp_cpu_offload=true", *seven_b]
    assert (
        plan.main(
            [
                "--preset",
                "rtx4090",
                "--gpu-mem-gb",
                "24",
                "--world-size",
                "2",
                "train.parallelism=fsdp",
                *offload,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "moved to CPU RAM per rank (train.fsdp_cpu_offload)" in out
    assert "trainer resident (weights + optimizer + ref) in RAM: none" in out
    assert "warning" not in out  # 7B full fine-tuning fits 2 × 24 GB with offload
    assert plan.main(["--world-size", "0"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: --world-size must be a whole number of ranks, at least 1; got 0"
    )


def test_a_filler_adds_no_gradient_under_a_kl_penalty():
    """A zero-weight filler (what FSDP tops a rank up with) carries π_ref = 0 as a placeholder;
    under β > 0 at a low temperature its log-prob can fall below −88.7, where k3 = exp(0 − log π)
    overflows: the filler must still add exactly nothing (no NaN reduce-scattered)."""
    from grpo_fast.loop.optimization import _accumulate_gradients
    from grpo_fast.loop.stats import StepStats

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    # an untied head that scores each token far below the others after itself: a filler [t, t]
    # with label t gets log π(t) ≪ 0 (with the tied head t is its own best successor)
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(-1000.0 * head.weight.detach().clone())
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    cfg = load_config("tiny", overrides=["loss.beta=0.04"])
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = Trainer(policy, build_optimizer(cfg, params), params, cfg)
    seqs = loss_trajectories(
        Rollout([tok("1+2=")["input_ids"]], [tok("3")["input_ids"]]),
        advantages=torch.ones(1),
        length_norm="token_mean",
        max_length=4,
    )
    like = make_microbatches(seqs, 1, tok.pad_token_id, packing=False)[0]
    like = dataclasses.replace(like, ref_logprobs=torch.zeros_like(like.labels, dtype=torch.float32))
    options = dataclasses.replace(cfg.loss.loss_options(), beta=0.04)
    # the tiny pad token's embedding is 0 (its filler's logits are all 0): a filler of a real
    # token instead, as a model whose pad token is a trained one (Qwen's <|endoftext|>) has
    filler = fsdp.fillers(1, like, tok.convert_tokens_to_ids("7"), torch.device("cpu"))[0]
    with torch.no_grad():
        assert policy(filler, options, 0.01).logprobs.min() < -88.7
    _accumulate_gradients(trainer, [], [], StepStats(), options, 0.01, None, fillers=[filler])
    grads = [p.grad for p in params if p.grad is not None]
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def _value_loop_worker(rank, world_size, port, root):
    """``loss.advantage=gae`` under FSDP on 2 ranks: a straight 3-step run, and the same run
    stopped after step 2 (its sharded checkpoint: weights, value head, AdamW's state for both),
    then resumed to step 3 in its folder."""
    from grpo_fast import train

    join_cpu_ranks(rank, world_size, port)
    dist._OWN_GROUP = False  # one process group for the three runs
    root = Path(root)
    more = ["loss.advantage=gae", "critic.lr=0.05", "steps=3", "checkpoint_every=2", "eval_every=0"]
    train.run(load_config("tiny", overrides=_loop_overrides(root / "straight", *more)))
    train.run(load_config("tiny", overrides=_loop_overrides(root / "part", *more, "steps=2")))
    if rank == 0:
        shutil.rmtree(root / "part" / "final")
    dist.barrier()
    train.run(load_config("tiny", overrides=_loop_overrides(root / "part", *more, "resume=true")))
    dist.shutdown()


@pytest.mark.slow
def test_the_value_head_resumes_from_a_sharded_checkpoint(tmp_path):
    """FSDP with a value head: the step-2 checkpoint holds the head's shards and its AdamW state
    (DCP names ``value_head.*``), and the resumed step 3 logs the straight run's metrics bitwise,
    its value loss included. Planted: the head left out of ``_sharded_models`` → the first
    checkpoint cannot be written (DCP finds no name for the head's AdamW state)."""
    start_ranks(_value_loop_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    diff = _metrics_diff()
    straight = diff.read_rows(tmp_path / "straight")
    assert [r["step"] for r in straight] == [1, 2, 3] and straight[-1]["train/value_loss"] > 0
    assert diff.differences(straight, diff.read_rows(tmp_path / "part")) == []
