"""One vLLM server for every trainer rank (``rollout.placement=server`` under torchrun):
``grpo_fast.rollout.vllm_ranks``, on 2 gloo ranks and the FAKE server (``tests/fake_vllm_server.py``,
a thread of the test's process).

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
from fake_vllm_server import FakeVLLMServer

from grpo_fast.policy.checkpoint import STATE_FILE
from grpo_fast.testing import main_on_ranks

RUN = [
    "--preset",
    "tiny",
    "sft.steps=0",
    "eval_every=0",
    "checkpoint_every=0",
    "steps=2",
    "rollout.group_size=4",
    "rollout.batch_size=16",  # 4 prompts: 2 per rank
    "train.micro_batch_size=8",
    "logging.progress=false",
    "logging.sample_every=0",
    "rollout.backend=vllm",
    "rollout.placement=server",
    "rollout.weight_sync_tolerance=100",  # the FAKE server's log-probs are canned
]


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
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_ranks_share_one_server_that_rank_0_alone_pushes_and_probes(tmp_path, parallelism):
    """2 steps on 2 ranks against one server: 3 weight syncs (the first policy, then each step's)
    and 3 probes, rank 0's; each rank sends its own 2 prompts per step, seeded by rank (8
    requests, 8 distinct seed ranges); both ranks exit 0 and rank 0's rows say world_size 2.
    Under FSDP rank 1 takes part in every gather of the push (else both ranks would wait on each
    other). Planted: every rank pushing (no ``RankShare``) → 6 syncs and 6 probes; a follower that
    skips the gathers under FSDP → the run does not finish."""
    with FakeVLLMServer() as fake:
        ranks = _two_ranks(
            [
                *RUN,
                f"rollout.server_url={fake.url}",
                f"train.parallelism={parallelism}",
                f"output_dir={tmp_path}",
            ],
            tmp_path,
        )
    assert [r["code"] for r in ranks] == [0, 0], ranks
    assert fake.calls.count("/start_weight_update") == 3
    assert fake.calls.count("/finish_weight_update") == 3
    assert fake.calls.count("/init_weight_transfer_engine") == 1  # rank 0's transport alone
    sampled, probes = _generations(fake)
    assert len(probes) == 3
    assert len(sampled) == 8 and all(b["sampling_params"]["n"] == 4 for b in sampled)
    assert len({b["sampling_params"]["seed"] for b in sampled}) == 8
    rows = [r for r in _rows(tmp_path) if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 for r in rows)
    assert all(r["rollout/weight_sync_abs_diff"] > 0 for r in rows)  # the canned log-probs: a gap, recorded


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_server_that_cannot_start_stops_both_ranks_with_its_line(tmp_path):
    """Rank 0 starts the server (no ``rollout.server_url``; here the command fails, vLLM is not
    installed in this environment): rank 1, waiting for its URL, raises rank 0's error instead of
    waiting for ever. And ``rollout.placement=process`` (one engine per trainer process) is
    refused under torchrun with one line naming the keys to use. Planted: a leader that raises
    without broadcasting → rank 1 never finishes."""
    ranks = _two_ranks([*RUN, "rollout.start_timeout=60", f"output_dir={tmp_path}/a"], tmp_path / "a")
    assert [r["code"] for r in ranks] == [2, 2], ranks
    assert ranks[0]["last"] == ranks[1]["last"] and ranks[0]["last"].startswith("error: the vLLM server"), (
        ranks
    )
    ranks = _two_ranks([*RUN, "rollout.placement=process", f"output_dir={tmp_path}/b"], tmp_path / "b")
    assert [r["code"] for r in ranks] == [2, 2], ranks
    assert all(
        r["last"]
        == "error: rollout.placement=process starts one engine for one trainer process: under torchrun "
        "use rollout.placement=server (one server every rank shares, on rollout.engine_devices) or colocated "
        "(one engine per rank)"
        for r in ranks
    ), ranks


# ---------------------------------------------------------------- rollout.max_staleness=1, 2 ranks

STALE = ["rollout.max_staleness=1", "rollout.old_logprobs=sampler", "steps=5"]


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_staleness_one_on_two_ranks_pushes_each_version_once_from_rank_0_s_producer(tmp_path, parallelism):
    """The pipeline on 2 ranks with one server: the trainers stage each version (under FSDP both
    gather it, rank 0 keeps the copy), the producers push it over their own group, rank 0's
    alone: 5 syncs (the first push at setup, then versions 0-3 as the jobs need them) and 5
    probes for 5 steps; each step's 4 prompts are sampled, 2 per rank, from version
    max(step − 2, 0), so the lag is the bound from step 2 on. Planted: every rank's producer
    pushing → 10 syncs; the trainers' share used by the producers (their collectives interleave
    with the trainers') → the run does not finish."""
    with FakeVLLMServer() as fake:
        ranks = _two_ranks(
            [
                *RUN,
                *STALE,
                f"rollout.server_url={fake.url}",
                f"train.parallelism={parallelism}",
                f"output_dir={tmp_path}",
            ],
            tmp_path,
        )
    assert [r["code"] for r in ranks] == [0, 0], ranks
    assert fake.calls.count("/start_weight_update") == 5
    sampled, probes = _generations(fake)
    assert len(probes) == 5 and len(sampled) == 20
    rows = [r for r in _rows(tmp_path) if r["step"] >= 1]
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r["world_size"] == 2 for r in rows)


def rank_1_server_dies_at_its_third_batch(rank: int) -> None:
    """On rank 1 only: its third generation (step 3's batch) finds the server dead."""
    lift_the_vllm_check(rank)
    if rank != 1:
        return
    from grpo_fast.errors import EngineDied
    from grpo_fast.rollout.vllm import VLLMBackend

    real, calls = VLLMBackend.generate, []

    def dying(self, prompt_ids, params, progress=None):
        calls.append(1)
        if len(calls) == 3:
            raise EngineDied(
                "the vLLM server at http://127.0.0.1:1 stopped answering during POST /inference/v1/generate (planted)"
            )
        return real(self, prompt_ids, params, progress=progress)

    VLLMBackend.generate = dying


@pytest.mark.slow
def test_a_producer_that_fails_on_one_rank_stops_both_with_the_checkpoint_and_the_resume_continues(tmp_path):
    """Rank 1's producer finds the server dead at step 3's batch, rank 0's does not: both ranks
    stop at step 3's rollout — rank 1 with its error, rank 0 with it under rank 1's name — after
    writing step 2's checkpoint together; the resume trains steps 3-5 at the bound. Planted: no
    agreement in ``Pipeline._collect`` → rank 0 trains step 3 while rank 1 writes a checkpoint:
    the ranks never finish."""
    args = [*RUN, *STALE, f"output_dir={tmp_path}"]
    with FakeVLLMServer() as fake:
        ranks = _two_ranks(
            [*args, f"rollout.server_url={fake.url}"],
            tmp_path / "a",
            setup="test_vllm_ranks:rank_1_server_dies_at_its_third_batch",
        )
    where = tmp_path / "checkpoints" / "step_000002"
    what = (
        "the vLLM server at http://127.0.0.1:1 stopped answering during POST /inference/v1/generate (planted)"
    )
    tail = (
        f"(during step 3's rollout): checkpoint {where} of step 2 written; resume=true continues from there"
    )
    assert [r["code"] for r in ranks] == [2, 2], ranks
    assert ranks[0]["last"] == f"error: rank 1: {what} {tail}", ranks
    assert ranks[1]["last"] == f"error: {what} {tail}", ranks
    assert (where / STATE_FILE).is_file()
    with FakeVLLMServer() as fake:
        ranks = _two_ranks([*args, f"rollout.server_url={fake.url}", "resume=true"], tmp_path / "b")
    assert [r["code"] for r in ranks] == [0, 0], ranks
    rows = [r for r in _rows(tmp_path) if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
