"""One vLLM server for every trainer rank (``rollout.placement=server`` under torchrun):
``grpo_fast.rollout.vllm.placement.ranks``, on 2 gloo ranks and the FAKE server
(``tests/fake_vllm_server.py``, a thread of the test's process).

Rank 0 pushes every version once and probes it; rank 1 takes part in the push's gathers (FSDP)
and sends its own prompts with its own seeds; a server that stops answering a sync stops both
ranks with the same line and one checkpoint, and the resume continues on both. Each run is
bounded: a rank left waiting in a collective would hang, which is the failure these tests catch.
The real server under torchrun runs in tests/test_vllm_server.py (``make test-vllm``).
"""

import dataclasses
import json
from pathlib import Path

import pytest
import test_vllm_apart
import torch
from fake_vllm_server import FakeVLLMServer
from support.ranks import main_on_ranks

from grpo_fast.errors import ConfigError
from grpo_fast.policy.checkpoint import STATE_FILE

# The 1-rank runs' arguments (tests/test_vllm_apart.py), 4 prompts a step: 2 per rank.
RUN = [*test_vllm_apart.RUN, "steps=2", "rollout.batch_size=16"]


def lift_the_vllm_check(rank: int) -> None:
    """A run attached to a server needs no vLLM: the check that it is installed is lifted."""
    from grpo_fast.rollout import registry

    spec = registry.backends()["vllm"]
    registry.backends()["vllm"] = dataclasses.replace(spec, missing=lambda: None)


def _two_ranks(args: list[str], out: Path, setup: str = "test_vllm_ranks:lift_the_vllm_check") -> list[dict]:
    try:
        return main_on_ranks(args, out, setup=setup)
    except TimeoutError as exc:
        pytest.fail(str(exc))


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _generations(fake: FakeVLLMServer) -> tuple[list[dict], list[dict]]:
    """(the sampling requests, the probes) the server received, in order."""
    bodies = [b for path, b in fake.bodies if path == "/inference/v1/generate"]
    probes = [b for b in bodies if b["sampling_params"].get("prompt_logprobs") is not None]
    return [b for b in bodies if b not in probes], probes


@pytest.mark.slow
@pytest.mark.xdist_group("two_ranks")  # one 2-rank run at a time on the 2 cores
def test_a_sync_that_hangs_stops_both_ranks_with_one_line_and_the_resume_continues_on_both(tmp_path):
    """The server stops answering step 2's weight sync (its third ``/update_weights``): after
    ``rollout.sync_timeout`` rank 0's error reaches rank 1, both stop with the same line naming
    step 2's checkpoint (written once, by both ranks' collective save) and exit 2; resumed against
    a healthy server, both train step 3. Planted: rank 1 not raising rank 0's outcome → it
    generates step 3 while rank 0 stops → the run does not finish."""
    args = [*RUN, "steps=3", "rollout.sync_timeout=1.5", f"output_dir={tmp_path}"]
    with FakeVLLMServer({"/update_weights": "hang@3"}) as fake:
        ranks = _two_ranks([*args, f"rollout.server_url={fake.url}"], tmp_path / "stopped")
    where = tmp_path / "checkpoints" / "step_000002"
    assert [r["code"] for r in ranks] == [2, 2], ranks
    for r in ranks:
        assert r["last"].startswith("error: the weight sync of step 2 did not finish within 1.5 s"), r
        assert r["last"].endswith(
            f"(during step 2's weight sync): checkpoint {where} of step 2 written; resume=true continues from there"
        ), r
    assert (where / STATE_FILE).is_file()
    assert [r["step"] for r in _rows(tmp_path) if r["step"] >= 1] == [1, 2]
    with FakeVLLMServer() as fake:
        ranks = _two_ranks([*args, f"rollout.server_url={fake.url}", "resume=true"], tmp_path / "resumed")
    assert [r["code"] for r in ranks] == [0, 0], ranks
    generate = fake.calls.index("/inference/v1/generate")
    assert "/update_weights" in fake.calls[:generate]  # the resume pushed step 2's weights first
    assert [r["step"] for r in _rows(tmp_path) if r["step"] >= 1] == [1, 2, 3]


class _Wire:
    """What ``RankShare.broadcast`` would carry between 2 ranks, played in one process: the
    leader's object is recorded; a follower receives ``sent``."""

    def __init__(self, sent=None):
        self.sent, self.got = sent, []

    def __call__(self, obj):
        self.got.append(obj)
        return self.sent if self.sent is not None else obj


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_start_and_a_failed_push_reach_every_rank(monkeypatch, rank):
    """Rank 0's server start fails: it sends the error before raising it, and rank 1, waiting
    for the URL, raises that error; rank 0's push fails: its outcome carries the error, every
    rank raises it (rank 1 after its own side, the gathers). Planted: a leader that raises
    without broadcasting → rank 1 waits for ever (under torchrun: until the group's timeout)."""
    from grpo_fast.errors import EngineTimeout
    from grpo_fast.rollout.vllm.placement.ranks import Outcome, RankShare

    failed = EngineTimeout("the vLLM server's start on http://127.0.0.1:9 did not finish within 2 s")
    share = RankShare(rank)
    wire = _Wire(sent=None if rank == 0 else failed)
    monkeypatch.setattr(share, "broadcast", wire)
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: None)

    def start():
        raise failed

    with pytest.raises(EngineTimeout) as err:
        share.attach(start, lambda url: pytest.fail("a follower of a server that did not start"))
    assert err.value is failed and wire.got == ([failed] if rank == 0 else [None])
    followed = []
    wire.sent = None if rank == 0 else Outcome(failed, None)
    with pytest.raises(EngineTimeout):
        share.push(lambda: (_ for _ in ()).throw(failed), lambda: followed.append("gathers"))
    assert followed == ([] if rank == 0 else ["gathers"])
    assert rank == 1 or wire.got[-1].error is failed


def _world_of_two(monkeypatch, rank: int = 0) -> None:
    """``torch.distributed`` as torchrun's rank ``rank`` of 2 would see it (no group is joined:
    what is checked here stops before any collective)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)


def _build_line(tmp_path, overrides) -> str:
    from grpo_fast.config import load_config
    from grpo_fast.rollout import BackendContext, backend
    from grpo_fast.task import tiny

    cfg = load_config(
        "tiny", overrides=["rollout.backend=vllm", *overrides, f"output_dir={tmp_path}"], check_device=False
    )
    tok = tiny.build_tokenizer()
    ctx = BackendContext(
        cfg, tiny.build_model(tok, seed=0), tok, torch.device("cpu"), model_path=str(tmp_path)
    )
    with pytest.raises(ConfigError) as err:
        backend("vllm").build(ctx)
    return str(err.value)


def test_an_engine_process_per_trainer_is_refused_under_torchrun_naming_the_keys(tmp_path, monkeypatch):
    _world_of_two(monkeypatch)
    assert _build_line(tmp_path, ["rollout.placement=process"]) == (
        "rollout.placement=process starts one engine for one trainer process: under torchrun use "
        "rollout.placement=server (one server every rank shares, on rollout.engine_devices) or colocated "
        "(one engine per rank)"
    )


@pytest.mark.parametrize("devices, says", [(None, "[0] (rollout.engine_devices unset: GPU 0)"),
                                           ("[1, 2]", "[1] (rollout.engine_devices=[1, 2])")])  # fmt: skip
def test_a_server_on_a_trainer_rank_s_gpu_is_refused(tmp_path, monkeypatch, devices, says):
    """On GPUs, local rank i trains on GPU i: a server the run starts (the trainer's device by
    default, or ``rollout.engine_devices``) on one of them is refused, naming a free GPU."""
    _world_of_two(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    more = [] if devices is None else [f"rollout.engine_devices={devices}"]
    assert _build_line(tmp_path, ["rollout.placement=server", *more]) == (
        f"the vLLM server would run on GPU(s) {says}, which the 2 trainer ranks use (local rank i "
        "trains on GPU i): give it GPUs of its own, e.g. rollout.engine_devices=[2]"
    )


# ---------------------------------------------------------------- rollout.max_staleness=1, 2 ranks

STALE = ["rollout.max_staleness=1", "rollout.old_logprobs=sampler", "steps=5"]


@pytest.mark.slow
@pytest.mark.xdist_group("two_ranks")  # one 2-rank run at a time on the 2 cores
def test_staleness_one_on_two_ranks_pushes_each_version_once_from_rank_0_s_producer(tmp_path):
    """The pipeline on 2 ranks with one server: the trainers stage each version (under FSDP both
    gather it, rank 0 keeps the copy), the producers push it over their own group, rank 0's
    alone: 5 syncs (the first push at setup, then versions 0-3 as the jobs need them) and 5
    probes for 5 steps; each step's 4 prompts are sampled, 2 per rank, from version
    max(step − 2, 0), so the lag is the bound from step 2 on; rank 0 alone opened the weight
    transport, and each rank's requests carry seeds of their own (20 requests, 20 seeds).
    Planted: every rank attaching as rank 0 (no ``RankShare``) → 10 syncs."""
    with FakeVLLMServer() as fake:
        ranks = _two_ranks(
            [
                *RUN,
                *STALE,
                f"rollout.server_url={fake.url}",
                "train.parallelism=fsdp",
                f"output_dir={tmp_path}",
            ],
            tmp_path,
        )
    assert [r["code"] for r in ranks] == [0, 0], ranks
    assert fake.calls.count("/start_weight_update") == 5
    assert fake.calls.count("/init_weight_transfer_engine") == 1  # rank 0's transport alone
    sampled, probes = _generations(fake)
    assert len(probes) == 5 and len(sampled) == 20 and all(b["sampling_params"]["n"] == 4 for b in sampled)
    assert len({b["sampling_params"]["seed"] for b in sampled}) == 20  # each rank, each step its own
    rows = [r for r in _rows(tmp_path) if r["step"] >= 1]
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r["world_size"] == 2 for r in rows)


def rank_1_server_dies_at_its_third_batch(rank: int) -> None:
    """On rank 1 only: its third generation (step 3's batch) finds the server dead."""
    _rank_1_server_dies_at(rank, 3)


def rank_1_server_dies_at_step_2_s_evaluation(rank: int) -> None:
    """On rank 1 only, ``eval_every=2``: its fourth generation (after step 0's evaluation and
    steps 1-2's batches: step 2's evaluation) finds the server dead."""
    _rank_1_server_dies_at(rank, 4)


DEAD = "the vLLM server at http://127.0.0.1:1 stopped answering during POST /inference/v1/generate (planted)"


def _both_stopped(ranks: list[dict], out: Path, during: str) -> Path:
    """Both ranks exited 2 after rank 1's server died (``DEAD``) during ``during``: rank 1 with
    its line, rank 0 with it under rank 1's name, each naming step 2's checkpoint, written by
    both; the checkpoint's folder."""
    where = out / "checkpoints" / "step_000002"
    tail = f"(during {during}): checkpoint {where} of step 2 written; resume=true continues from there"
    assert [r["code"] for r in ranks] == [2, 2], ranks
    assert ranks[0]["last"] == f"error: rank 1: {DEAD} {tail}", ranks
    assert ranks[1]["last"] == f"error: {DEAD} {tail}", ranks
    assert (where / STATE_FILE).is_file()
    return where


def _rank_1_server_dies_at(rank: int, nth: int) -> None:
    lift_the_vllm_check(rank)
    if rank != 1:
        return
    from grpo_fast.errors import EngineDied
    from grpo_fast.rollout.vllm import VLLMBackend

    real, calls = VLLMBackend.generate, []

    def dying(self, prompt_ids, params, progress=None):
        calls.append(1)
        if len(calls) == nth:
            raise EngineDied(DEAD)
        return real(self, prompt_ids, params, progress=progress)

    VLLMBackend.generate = dying


@pytest.mark.slow
@pytest.mark.xdist_group("two_ranks")  # one 2-rank run at a time on the 2 cores
def test_a_producer_that_fails_on_one_rank_stops_both_with_the_checkpoint(tmp_path):
    """Rank 1's producer finds the server dead at step 3's batch, rank 0's does not: both ranks
    stop at step 3's rollout — rank 1 with its error, rank 0 with it under rank 1's name — after
    writing step 2's checkpoint together, which holds step 3's job (the one rank 0 had its batch
    for). Planted: no agreement in ``Pipeline._collect`` → rank 0 trains step 3 while rank 1
    writes a checkpoint: the ranks never finish; the job dropped once rank 0's batch came → the
    checkpoint's jobs start at step 4 (a resume waited for step 3's batch for ever)."""
    args = [*RUN, *STALE, f"output_dir={tmp_path}"]
    with FakeVLLMServer() as fake:
        ranks = _two_ranks(
            [*args, f"rollout.server_url={fake.url}"],
            tmp_path / "a",
            setup="test_vllm_ranks:rank_1_server_dies_at_its_third_batch",
        )
    where = _both_stopped(ranks, tmp_path, "step 3's rollout")
    jobs = torch.load(where / STATE_FILE, weights_only=False)["pipeline"]["jobs"]
    assert [(j["step"], j["version"]) for j in jobs] == [(3, 1), (4, 2)]


@pytest.mark.slow
@pytest.mark.xdist_group("two_ranks")  # one 2-rank run at a time on the 2 cores
def test_a_lockstep_rollout_that_fails_on_one_rank_stops_both_with_the_checkpoint_and_resumes(tmp_path):
    """Lockstep (no pipeline) on 2 ranks: rank 1's generation finds the server dead at step 3,
    rank 0's does not. The ranks agree after each production round (``grpo_fast.loop.agreement``):
    both stop at step 3's rollout — rank 1 with its error, rank 0 with it under rank 1's name —
    after writing step 2's checkpoint together; resumed against a healthy server both train step
    3, rank 0 sending the very request it sent before the stop (its prompts and seed: the sampler
    and RNG streams put back as they were when step 3's rollout began). Planted: no agreement →
    rank 0 waits in the pass-rate gather while rank 1 exits: the ranks never finish; the
    sampler not put back → rank 0's resumed request differs."""
    args = [*RUN, "steps=3", f"output_dir={tmp_path}"]
    with FakeVLLMServer() as fake:
        ranks = _two_ranks(
            [*args, f"rollout.server_url={fake.url}"],
            tmp_path / "a",
            setup="test_vllm_ranks:rank_1_server_dies_at_its_third_batch",
        )
    stopped, _ = _generations(fake)
    _both_stopped(ranks, tmp_path, "step 3's rollout")
    assert [r["step"] for r in _rows(tmp_path) if r["step"] >= 1] == [1, 2]
    assert len(stopped) == 10  # a request a prompt, 2 prompts a rank: steps 1-2 on both, step 3 on rank 0
    with FakeVLLMServer() as fake:
        ranks = _two_ranks([*args, f"rollout.server_url={fake.url}", "resume=true"], tmp_path / "b")
    assert [r["code"] for r in ranks] == [0, 0], ranks
    resumed = [_without_id(b) for b in _generations(fake)[0]]
    assert len(resumed) == 4  # step 3's, both ranks
    for body in stopped[-2:]:  # rank 0's step-3 requests, as before the stop: prompts, seeds
        assert _without_id(body) in resumed
    assert [r["step"] for r in _rows(tmp_path) if r["step"] >= 1] == [1, 2, 3]


def _without_id(body: dict) -> dict:
    """A sampling request without its ``request_id`` (a fresh one for every request)."""
    return {k: v for k, v in body.items() if k != "request_id"}


@pytest.mark.slow
@pytest.mark.xdist_group("two_ranks")  # one 2-rank run at a time on the 2 cores
def test_an_evaluation_that_fails_on_one_rank_stops_both_with_the_step_s_checkpoint(tmp_path):
    """Under FSDP, rank 1's share of step 2's evaluation finds the server dead, rank 0's does not:
    the ranks agree once each graded its share, before the evaluation's sums, so both stop with
    step 2's row (without the evaluation) and its checkpoint, written together (a collective save
    under FSDP). Planted: no agreement (``evaluate`` without ``graded``) → rank 0 waits in the sums
    while rank 1 saves: the ranks never finish."""
    args = [*RUN, "eval_every=2", "train.parallelism=fsdp", f"output_dir={tmp_path}"]
    with FakeVLLMServer() as fake:
        ranks = _two_ranks(
            [*args, f"rollout.server_url={fake.url}"],
            tmp_path / "a",
            setup="test_vllm_ranks:rank_1_server_dies_at_step_2_s_evaluation",
        )
    _both_stopped(ranks, tmp_path, "step 2's evaluation (the step's row has none)")
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" not in rows[2]
