"""What must agree across data-parallel ranks and what must differ, on 2 CPU ranks (gloo): the
health monitor's temperature boost agrees, the hf sampling streams differ, and each rank rewards
and trains every response under the prompt it answers."""

import socket

import pytest
import torch
from support.ranks import join_cpu_ranks, start_ranks

from grpo_fast import dist
from grpo_fast.loop.setup import seed_everything
from grpo_fast.obs.health import HealthMonitor, HealthThresholds
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.rollout.sampling import sampling_rng, step_seed
from grpo_fast.task import tiny

LOOP = "the answer is 5 " * 20  # a repetition loop: arms the boost
PROSE = "First add the two numbers, then divide the sum by three to get the mean of the values."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _boost_worker(rank, world_size, port, looping_rank, out_path):
    join_cpu_ranks(rank, world_size, port)
    mon = HealthMonitor(HealthThresholds(auto_temperature_boost=True))
    responses = [LOOP] * 4 if rank == looping_rank else [PROSE] * 4  # each rank sees its own share
    mon.update(5, {}, responses)
    rows = [(mon.temperature_boost(step), mon.shared_temperature_boost(step)) for step in (5, 6, 10, 15)]
    gathered = dist.all_gather_objects(rows)
    if rank == 0:
        torch.save(gathered, out_path)
    dist.shutdown()


def _boosts(tmp_path, looping_rank):
    out = tmp_path / f"boost_{looping_rank}.pt"
    start_ranks(_boost_worker, args=(2, _free_port(), looping_rank, str(out)), nprocs=2, join=True)
    return torch.load(out)  # [rank][step] -> (local boost, shared boost)


def test_temperature_boost_agrees_across_ranks(tmp_path):
    # rank 1 alone sees loops: its local boost differs from rank 0's (the bug: two temperatures
    # in one step); the shared boost is rank 0's (none) on both ranks
    by_rank = _boosts(tmp_path, looping_rank=1)
    local = [[lb for lb, _ in rows] for rows in by_rank]
    shared = [[sb for _, sb in rows] for rows in by_rank]
    assert local[0] == [0.0] * 4 and local[1][0] > 0
    assert shared[0] == shared[1] == local[0]
    # rank 0 sees loops: both ranks raise the temperature by 0.2 at step 5, decaying linearly
    # over temperature_boost_steps = 10 (0.2·(1 − 1/10) = 0.18 at step 6, 0.1 at 10, 0 at 15)
    by_rank = _boosts(tmp_path, looping_rank=0)
    shared = [[sb for _, sb in rows] for rows in by_rank]
    assert shared[0] == shared[1]
    assert [round(b, 6) for b in shared[0]] == [0.2, 0.18, 0.1, 0.0]


def _sample(seed: int | None):
    """Responses of the tiny model to 4 fixed prompts × 8 samples, right after the loop's
    ``seed_everything(0)``, inside ``sampling_rng(seed)``; and whether the RNG was restored."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    backend = HFBackend(model, tok, generation_batch_size=64)
    prompts = [tok(q)["input_ids"] for q in ("12+34=", "56+7=", "8+91=", "23+45=")]
    params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0)
    seed_everything(0)
    before = torch.get_rng_state()
    with sampling_rng(seed, torch.device("cpu")):
        ids = backend.generate(prompts, params).response_ids
    restored = torch.equal(torch.get_rng_state(), before)
    return ids, restored


def _sampling_worker(rank, world_size, port, out_path):
    join_cpu_ranks(rank, world_size, port)
    plain, _ = _sample(None)  # every rank seeded alike, as seed_everything(cfg.seed) leaves them
    own, restored = _sample(step_seed(0, 1, rank))  # what the loop passes on step 1
    gathered = dist.all_gather_objects((plain, own, restored))
    if rank == 0:
        torch.save(gathered, out_path)
    dist.shutdown()


def test_each_rank_samples_its_own_stream(tmp_path):
    out = tmp_path / "samples.pt"
    start_ranks(_sampling_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    (plain0, own0, restored0), (plain1, own1, restored1) = torch.load(out)
    assert plain0 == plain1  # the bug: the same prompts would get the same samples on both ranks
    assert own0 != own1
    assert restored0 and restored1  # the global RNG is left as it was: ranks stay in lockstep


def _own_prompt_worker(rank, world_size, port, out_dir):
    """Two GRPO steps of the tiny preset on this rank, with the answering policy of
    tests/answer_oracle.py; saves what each training sequence was judged."""
    import answer_oracle

    from grpo_fast.config import load_config
    from grpo_fast.policy import loss as loss_mod
    from grpo_fast.train import run

    join_cpu_ranks(rank, world_size, port)
    tok = tiny.build_tokenizer()
    answer_oracle.install_in_process(tok)
    seen = []
    real = loss_mod.PolicyLoss.forward

    def recording(self, mb, *a, **k):
        if torch.is_grad_enabled():
            seen.extend(answer_oracle.check_microbatch(mb, tok))
        return real(self, mb, *a, **k)

    loss_mod.PolicyLoss.forward = recording
    overrides = [f"output_dir={out_dir}", "steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0",
                 "rollout.batch_size=32", "train.micro_batch_size=5", "logging.progress=false"]  # fmt: skip
    run(load_config("tiny", overrides=overrides))
    torch.save(seen, f"{out_dir}/seen_{rank}.pt")
    dist.shutdown()


@pytest.mark.slow
def test_each_rank_rewards_and_trains_responses_under_their_own_prompts(tmp_path):
    """Each rank draws its own share of the prompts: with a policy answering each row's own prompt
    (right on a group's even samples, ten times that on the odd ones), the global reward mean is exactly
    1/2 on every step, and on both ranks every training sequence holds a response behind the prompt
    it answers, its advantage positive exactly where it is right."""
    import json

    start_ranks(_own_prompt_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [(r["world_size"], r["train/reward_mean"], r["train/accuracy"]) for r in steps] == [
        (2, 0.5, 0.5)
    ] * 2
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"seen_{rank}.pt")
        assert len(seen) == 2 * 16 and sorted(set(seen)) == ["right+", "tenfold-"], (rank, seen)


def test_one_rank_sampling_is_unchanged():
    """One rank gets ``sampling_rng(None)``: the same samples, and the same RNG state after them,
    as a plain ``generate`` (1-rank runs reproduce what they gave before)."""
    tok = tiny.build_tokenizer()
    backend = HFBackend(tiny.build_model(tok, seed=0), tok, generation_batch_size=64)
    prompts = [tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]]
    params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0)
    seed_everything(0)
    plain = backend.generate(prompts, params).response_ids
    state_plain = torch.get_rng_state()
    seed_everything(0)
    with sampling_rng(None, torch.device("cpu")):
        wrapped = backend.generate(prompts, params).response_ids
    assert wrapped == plain
    assert torch.equal(torch.get_rng_state(), state_plain)
