"""A fleet of rollout engines (grpo_fast.rollout.fleet): shards fixed by the call, balanced by
load, every engine loaded and probed, a failed one out of service, its shard re-sent with the
same seed, restarted in the background, given up in one line; below rollout.min_engines one
line. On fake engines in this process (the fleet's logic), then on two real hf workers with one
SIGKILLed mid-run (the whole loop: steps lost, the restart, the same metrics)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_fast.errors import EngineDied, EngineTimeout, WeightSyncError
from grpo_fast.rollout import fleet as fleet_mod
from grpo_fast.rollout.base import Rollout, SamplingParams
from grpo_fast.rollout.fleet import Fleet, shard_seed, shards
from grpo_fast.train import main

PARAMS = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0, seed=7)


class FakeEngine:
    """Answers prompt p with tokens drawn from (p, seed, row): which engine answers changes
    nothing. ``die_at``: the request number (1, 2, ...) that raises ``EngineDied`` instead;
    ``gate``: an event the engine's requests wait on."""

    def __init__(self, index: int, log: list, die_at: int | None = None, gate=None, bad_probe=False):
        self.index, self.log, self.die_at, self.gate, self.bad_probe = index, log, die_at, gate, bad_probe
        self.requests, self.version, self.closed = 0, None, False

    def generate(self, prompt_ids, params, progress=None):
        self.requests += 1
        self.log.append(("generate", self.index, len(prompt_ids)))
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.requests == self.die_at:
            raise EngineDied(f"engine {self.index} died")
        ids = [
            [(sum(p) * 31 + params.seed * 7 + k) % 97 for _ in range(3)]
            for p in prompt_ids
            for k in range(params.n)
        ]
        if progress is not None:
            progress(len(prompt_ids))
        return Rollout(prompt_ids, ids, ["x"] * len(ids), policy_version=[self.version or 0] * len(ids))

    def load(self, version):
        self.log.append(("load", self.index, version))
        if self.bad_probe:
            raise WeightSyncError(f"engine {self.index} serves other weights")
        self.version = version

    def close(self):
        self.closed = True


def _fleet(num=2, min_engines=1, make=None, **kw):
    """A fleet of fake engines; ``make(i, nth_start)`` builds each (default: a healthy one)."""
    log, lines, starts = [], [], {}

    def start(i):
        starts[i] = starts.get(i, 0) + 1
        return (make or (lambda i, n, log: FakeEngine(i, log)))(i, starts[i], log)

    fleet = Fleet(
        start,
        lambda staged: staged,
        lambda engine, shared, version: engine.load(version),
        lambda model, keep=True: model,
        num_engines=num,
        min_engines=min_engines,
        generation_batch_size=kw.pop("generation_batch_size", 64),
        warn=lines.append,
        what="engine",
    )
    return fleet, log, lines, starts


def _wait(cond, limit=30.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "timed out"
        time.sleep(0.01)


PROMPTS = [[i, i + 1] for i in range(8)]


def test_shards_are_fixed_by_the_call_alone():
    assert shards(8, 2, 2, 64) == [range(0, 4), range(4, 8)]
    assert shards(7, 2, 2, 64) == [range(0, 4), range(4, 7)]
    assert shards(8, 4, 2, 8) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]  # the batch caps
    assert shards(3, 64, 4, 8) == [range(0, 1), range(1, 2), range(2, 3)]  # at least one prompt
    assert shards(0, 2, 2, 64) == []
    assert len({shard_seed(7, i) for i in range(100)}) == 100 and shard_seed(None, 3) is None


def test_a_fleet_answers_in_prompt_order_whichever_engine_serves():
    fleet, log, lines, _ = _fleet()
    out = fleet.generate(PROMPTS, PARAMS)
    assert out.prompt_ids == PROMPTS and out.sizes == [2] * 8
    seeds = [shard_seed(7, 0)] * 4 + [shard_seed(7, 1)] * 4  # shard i's seed, not the engine's
    want = [[(sum(p) * 31 + s * 7 + k) % 97] * 3 for p, s in zip(PROMPTS, seeds) for k in range(2)]
    assert out.response_ids == want
    assert sorted(e for kind, e, _ in log if kind == "generate") == [0, 1] and not lines


def test_requests_go_to_the_engine_with_fewest_in_flight():
    """Engine 0 holds its first request until engine 1 has answered three: the other shards go to
    the idle engine (one request at a time each), not round-robin."""
    gate = threading.Event()

    def make(i, n, log):
        engine = FakeEngine(i, log, gate=gate if i == 0 else None)
        return engine

    fleet, log, _, _ = _fleet(make=make, generation_batch_size=4)  # 8 prompts × 2: 4 shards of 2
    watcher = threading.Thread(
        target=lambda: (
            _wait(lambda: sum(1 for k, e, _ in log if k == "generate" and e == 1) == 3),
            gate.set(),
        )
    )
    watcher.start()
    out = fleet.generate(PROMPTS, PARAMS)
    watcher.join()
    assert [e for k, e, _ in log if k == "generate"].count(1) == 3 and out.prompt_ids == PROMPTS
    m = fleet.take_metrics()
    assert (m["fleet/engine0/requests"], m["fleet/engine1/requests"]) == (1.0, 3.0)
    assert (
        m["fleet/engine1/tokens"] == 3 * 2 * 2 * 3 and fleet.take_metrics()["fleet/engine1/requests"] == 0.0
    )


def test_a_dead_engine_s_shard_is_re_sent_and_the_engine_comes_back_loaded_and_probed(monkeypatch):
    """Engine 1 dies on its first request: one warning line naming it, its shard answered by
    engine 0 with the same seed (the same tokens as a healthy fleet's), the run goes on; engine
    1 is started again, loaded with the version the fleet serves, and serves again."""
    healthy, *_ = _fleet()
    healthy.load_weights("w3", 3)
    want = healthy.generate(PROMPTS, PARAMS)

    fleet, log, lines, starts = _fleet(
        make=lambda i, n, log: FakeEngine(i, log, die_at=1 if (i, n) == (1, 1) else None)
    )
    fleet.load_weights("w3", 3)
    got = fleet.generate(PROMPTS, PARAMS)
    assert got.response_ids == want.response_ids and got.policy_version == [3] * 16
    assert lines[0] == (
        "warning: engine 1 out of service (engine 1 died; shard 1 (4 prompts) re-sent): 1 of 2 serve; "
        "restarting it in the background"
    )
    _wait(lambda: len(lines) == 2)
    assert lines[1].startswith("warning: engine 1 back in service after ") and lines[1].endswith(
        "(restart 1), serving policy version 3 (probed)"
    )
    after = [x for x in log if x[1] == 1][2:]  # engine 1: load, the request it died in, then ...
    assert starts[1] == 2 and after[0] == ("load", 1, 3)  # loaded with version 3 before it serves
    m = fleet.take_metrics()
    assert (
        m["fleet/engines_serving"] == 2.0
        and m["fleet/restarts"] == 1.0
        and m["fleet/engine1/restarts"] == 1.0
    )
    log.clear()
    fleet.generate(PROMPTS, PARAMS)
    assert sorted(e for k, e, _ in log if k == "generate") == [0, 1]  # both serve again
    fleet.close()


def test_an_engine_that_fails_its_probe_is_out_of_service_until_a_restart_passes():
    fleet, log, lines, starts = _fleet(make=lambda i, n, log: FakeEngine(i, log, bad_probe=(i, n) == (0, 1)))
    fleet.load_weights("w1", 1)
    assert lines[0].startswith(
        "warning: engine 0 out of service (engine 0 serves other weights; loading policy version 1)"
    )
    _wait(lambda: len(lines) == 2)
    assert starts[0] == 2 and ("load", 0, 1) in log[-2:] and fleet.version == 1
    assert "back in service" in lines[1]
    fleet.close()


def test_below_min_engines_the_call_raises_one_line_naming_the_key():
    def make(i, n, log):
        if n > 1:  # its restart fails too: it stays down
            raise EngineDied("engine 1 failed to start")
        return FakeEngine(i, log, die_at=1 if i == 1 else None)

    fleet, *_ = _fleet(min_engines=2, make=make)
    with pytest.raises(EngineDied) as err:
        fleet.generate(PROMPTS, PARAMS)
    assert str(err.value) == (
        "1 of 2 engines in service, below rollout.min_engines=2 (0: serving, 1: down), while generating 8 prompts × 2"
    )
    fleet.close()


def test_an_engine_that_never_comes_back_is_given_up_in_one_line(monkeypatch):
    """Every restart fails (a start past its timeout): RESTART_TRIES tries, then one line; the
    fleet goes on with the engine that serves."""
    monkeypatch.setattr(fleet_mod, "RESTART_PAUSE_S", 0.0)

    def make(i, n, log):
        if i == 1 and n > 1:
            raise EngineTimeout(
                f"engine 1 did not finish starting within rollout.start_timeout=1 s (try {n - 1})"
            )
        return FakeEngine(i, log, die_at=1 if i == 1 else None)

    fleet, _, lines, starts = _fleet(make=make)
    fleet.generate(PROMPTS, PARAMS)
    _wait(lambda: len(lines) == 2)
    assert starts[1] == 1 + fleet_mod.RESTART_TRIES
    assert lines[1].startswith(
        f"warning: engine 1 given up after {fleet_mod.RESTART_TRIES} failed restarts in "
    )
    assert lines[1].endswith(
        "(last: engine 1 did not finish starting within rollout.start_timeout=1 s (try 3))"
    )
    assert fleet.take_metrics()["fleet/engine1/serving"] == 0.0
    assert fleet.generate(PROMPTS, PARAMS).prompt_ids == PROMPTS  # engine 0 alone
    fleet.close()


def test_a_call_ended_by_its_progress_leaves_the_fleet_usable():
    """``progress`` raising (a stop) ends the call at once; an engine still answering it takes
    no new request until it has, and the next call is whole."""

    class Stop(Exception):
        pass

    fleet, *_ = _fleet()

    def progress(n):
        raise Stop

    with pytest.raises(Stop):
        fleet.generate(PROMPTS, PARAMS, progress=progress)
    assert fleet.generate(PROMPTS, PARAMS).prompt_ids == PROMPTS
    fleet.close()


def test_a_shard_that_kills_every_engine_it_reaches_stops_the_call():
    """A request that takes down each engine it is sent to (the same prompts, the same seed:
    say, memory) is re-sent at most ``SHARD_TRIES`` times, then the call raises one line."""

    class Poisoned(FakeEngine):
        def generate(self, prompt_ids, params, progress=None):
            if prompt_ids[0] == PROMPTS[4]:
                raise EngineDied(f"engine {self.index} died")
            return super().generate(prompt_ids, params, progress)

    fleet, _, lines, _ = _fleet(num=4, make=lambda i, n, log: Poisoned(i, log))  # one always serves
    with pytest.raises(EngineDied) as err:
        fleet.generate(PROMPTS, PARAMS)
    assert str(err.value).startswith(
        f"shard 2 (2 prompts) took down {fleet_mod.SHARD_TRIES} engines in a row (last: engine "
    )
    assert sum("out of service" in ln for ln in lines) == fleet_mod.SHARD_TRIES
    fleet.close()


def test_a_bug_in_an_engine_is_raised_not_hidden():
    class Buggy(FakeEngine):
        def generate(self, *a, **k):
            raise RuntimeError("a bug")

    fleet, _, lines, _ = _fleet(make=lambda i, n, log: Buggy(i, log))
    with pytest.raises(RuntimeError, match="a bug"):
        fleet.generate(PROMPTS, PARAMS)
    assert not lines
    fleet.close()


def test_a_fleet_whose_engines_cannot_start_raises_the_first_failure():
    def make(i, n, log):
        raise EngineDied(f"engine {i} failed to start")

    with pytest.raises(EngineDied, match="engine 0 failed to start"):
        _fleet(make=make)


# ------------------------------------------------------------ two real hf workers, the whole loop

FLEET = ["rollout.placement=process", "rollout.num_engines=2", "steps=6"]


@pytest.mark.slow
def test_a_worker_killed_mid_run_loses_no_step_comes_back_and_changes_no_metric(
    tmp_path, monkeypatch, capsys
):
    """Two hf workers, staleness 1; worker 1 SIGKILLed as its second request (step 2's shard)
    begins: one warning line, the shard re-sent to worker 0, the run finishes all 6 steps; worker 1
    is restarted, loaded and probed, and serves step 5's rollout (the test waits for it there:
    a restart takes seconds, the tiny steps milliseconds). Every learning metric of every step and
    the final weights equal an uninterrupted fleet's. Planted: a re-sent shard with the engine's
    own seed instead of the shard's → step 2's rollout differs."""
    from test_pipeline import MACHINE, QUICK, S1, _rows, _weights

    from grpo_fast.rollout.hf.process import HFProcessBackend

    real_generate, calls, killed = HFProcessBackend.generate, [], []

    def planted(self, *a, **k):
        if self.name.endswith(" 1"):
            calls.append(1)
            if len(calls) == 2:
                killed.append(self.pid)
                os.kill(self.pid, signal.SIGKILL)
        return real_generate(self, *a, **k)

    real_fleet_generate, fleet_calls = Fleet.generate, []

    def whole_before_step_5(self, *a, **k):
        fleet_calls.append(1)
        if len(fleet_calls) == 5:
            _wait(lambda: len(self.serving) == 2, limit=300)  # measured ~5 s (a worker's start)
        return real_fleet_generate(self, *a, **k)

    monkeypatch.setattr(HFProcessBackend, "generate", planted)
    monkeypatch.setattr(Fleet, "generate", whole_before_step_5)
    out = tmp_path / "killed"
    assert main([*QUICK, *S1, *FLEET, f"output_dir={out}"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: hf rollout worker")]
    assert err[0] == (
        f"warning: hf rollout worker 1 out of service (the hf rollout worker 1 (pid {killed[0]}) exited (killed "
        "by SIGKILL) while generating 2 prompts × 4; shard 1 (2 prompts) re-sent): 1 of 2 serve; restarting it "
        "in the background"
    )
    assert (
        err[1].startswith("warning: hf rollout worker 1 (the hf rollout worker 1 (pid ")
        and "back in service" in err[1]
    )
    assert len(err) == 2 and not _pid_alive(killed[0])
    monkeypatch.undo()
    assert main([*QUICK, *S1, *FLEET, f"output_dir={tmp_path / 'straight'}"]) == 0
    learning = lambda rows: [
        {k: v for k, v in r.items() if not k.startswith(("fleet/", *MACHINE))} for r in rows
    ]
    a, b = _rows(out), _rows(tmp_path / "straight")
    assert learning(a) == learning(b) and len([r for r in a if "train/loss" in r]) == 6
    wa, wb = _weights(out / "final"), _weights(tmp_path / "straight" / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    by_step = {r["step"]: r for r in a if "fleet/restarts" in r}
    assert by_step[2]["fleet/engine0/requests"] == 2.0 and by_step[2]["fleet/engine1/requests"] == 0.0
    assert by_step[5]["fleet/engine1/requests"] == 1.0 and by_step[6]["fleet/restarts"] == 1.0
    assert {r["fleet/restarts"] for r in _rows(tmp_path / "straight") if "fleet/restarts" in r} == {0.0}


def test_a_lora_fleet_samples_from_the_trainers_adapter_at_every_step(tmp_path):
    """LoRA (configs/lora.yaml) on two hf workers, lockstep: what a version stages, every worker
    loads and the digest probes is the adapter (the tensors that train), so at every step both
    workers sample from the trainer's weights: the sampler's log-probs of the sampled tokens are
    the trainer's to fp32 noise (measured 0.8-1.3e-7) while the adapter moves. Planted: the
    adapter's B matrices left out of a version (the workers keep B = 0, the base model) → step
    2's gap is ~1e-2."""
    from test_lora import LORA_YAML
    from test_pipeline import QUICK, _rows

    out = tmp_path / "lora"
    assert main([*QUICK, "--config", LORA_YAML, *FLEET[:2], "steps=4", f"output_dir={out}"]) == 0
    rows = [r for r in _rows(out) if "train/loss" in r]
    assert [r["fleet/engines_serving"] for r in rows] == [2.0] * 4
    assert all(r["fleet/engine0/requests"] == r["fleet/engine1/requests"] == 1.0 for r in rows)
    assert all(r["rollout/logprob_abs_diff"] < 1e-5 for r in rows), [
        r["rollout/logprob_abs_diff"] for r in rows
    ]
    assert all(r["train/grad_norm"] > 0 for r in rows)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_s_load_is_probed_by_the_digest_of_what_it_holds():
    """A load whose staged tensors the worker does not hold (here: the digest of other values)
    is a ``WeightSyncError`` naming the worker and the first tensor; a true load passes. The
    digest is exact integer arithmetic: equal bytes, equal digest, whatever the threads."""
    from grpo_fast.rollout.hf.copied import trainable_tensors, weights_digest
    from grpo_fast.rollout.hf.process import HFProcessBackend
    from grpo_fast.task import tiny

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    tensors = {k: v.clone() for k, v in trainable_tensors(model).items()}
    worker = HFProcessBackend(model, tok, 64, threads=1, name="3")
    try:
        worker.load_weights(tensors, 1)
        assert worker.version == 1
        first = next(iter(tensors))
        other = dict(tensors, **{first: tensors[first] + 1e-3})
        with pytest.raises(WeightSyncError) as err:
            worker.load_shared(2, weights_digest(other))
        assert str(err.value) == (
            f"the hf rollout worker 3 (pid {worker.pid}) serves other weights than policy version 2's after "
            f"its load: the digest of 1 of {len(tensors)} tensors differs (first {first})"
        )
        assert worker.version == 1
    finally:
        worker.close()


# -- a fleet of vLLM servers: the loop against FAKE servers in processes -------------------------

VLLM_RUN = [
    "--preset", "tiny", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "steps=4",
    "rollout.group_size=4", "rollout.batch_size=8", "train.micro_batch_size=8", "data.eval_subset_size=8",
    "logging.progress=false", "logging.sample_every=0", "rollout.backend=vllm", "rollout.placement=server",
    "rollout.weight_sync_tolerance=100",  # the FAKE servers' log-probs are canned
    "rollout.start_timeout=60",  # how long a listed server that went down is waited for
]  # fmt: skip


def _fake_server(port: int, log: Path, behaviour: dict | None = None):
    """tests/fake_vllm_server.py in a process of its own on ``port``, listening; its output in ``log``."""
    import json
    import subprocess
    import sys

    from grpo_fast.rollout.vllm.deadline import Deadline
    from grpo_fast.rollout.vllm.placement.server import wait_listening

    script = str(Path(__file__).with_name("fake_vllm_server.py"))
    with open(log, "w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, script, str(port), json.dumps(behaviour or {})], stdout=out)
    wait_listening(f"http://127.0.0.1:{port}", Deadline(30, "the fake server's start", "test"))
    return proc


def test_a_listed_vllm_server_killed_mid_run_is_dropped_attached_again_and_serves(
    tmp_path, monkeypatch, capsys
):
    """``rollout.server_url`` lists two servers (FAKE vLLM servers, each a process): server 0 is
    SIGKILLed while step 2's request hangs on it. One warning line, its shard re-sent to server 1,
    the run trains all 4 steps; a fresh server on the same port (its supervisor's restart) is
    attached again, loaded and probed, and serves step 4 (the test waits for it there). Every
    version is loaded on both servers. Planted: a listed server attached again without waiting
    for it to listen → it is given up (3 refused connections) and step 4 never has 2 engines."""
    import dataclasses
    import json

    from grpo_fast.rollout import registry
    from grpo_fast.rollout.vllm.transfer.transport import free_port

    spec = registry.backends()["vllm"]  # attached servers need no vLLM here
    monkeypatch.setitem(registry.backends(), "vllm", dataclasses.replace(spec, missing=lambda: None))
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"fake{i}.log" for i in range(3)]
    hung = {"/inference/v1/generate": "hang@4"}  # calls: the first probe, step 1, its probe, step 2
    procs = [_fake_server(ports[0], logs[0], hung), _fake_server(ports[1], logs[1])]
    back: list = []

    def kill_then_restart() -> None:
        _wait(lambda: (tmp_path / "fake0.log").read_text().count("request /inference/v1/generate") >= 4, 60)
        procs[0].kill()
        procs[0].wait()
        time.sleep(4.0)  # down longer than the 3 tries 1 s apart a restart of a started engine gets
        back.append(_fake_server(ports[0], logs[2]))

    killer = threading.Thread(target=kill_then_restart, daemon=True)
    killer.start()
    real_generate, calls = Fleet.generate, []

    def whole_before_step_4(self, *a, **k):
        calls.append(1)
        if len(calls) == 4:
            _wait(lambda: len(self.serving) == 2, limit=60)  # measured ~5 s
        return real_generate(self, *a, **k)

    monkeypatch.setattr(Fleet, "generate", whole_before_step_4)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        out = tmp_path / "run"
        assert main([*VLLM_RUN, f"rollout.server_url=[{urls[0]},{urls[1]}]", f"output_dir={out}"]) == 0
    finally:
        for p in [*procs, *back]:
            p.kill()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: vLLM server")]
    assert err[0].startswith(f"warning: vLLM server 0 out of service (the vLLM server at {urls[0]} stopped ")
    assert err[0].endswith("shard 0 (1 prompts) re-sent): 1 of 2 serve; restarting it in the background"), err
    # the version it loads is the one the fleet serves when it is back (1, 2 or 3: a matter of timing)
    assert re.fullmatch(
        rf"warning: vLLM server 0 \({urls[0]}\) back in service after [0-9.]+ s \(restart 1\), serving "
        r"policy version [123] \(probed\)",
        err[1],
    ), err
    assert len(err) == 2
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    by_step = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(by_step) == [1, 2, 3, 4]
    assert by_step[2]["fleet/engine0/requests"] == 0.0 and by_step[2]["fleet/engine1/requests"] == 2.0
    assert by_step[4]["fleet/engine0/requests"] == 1.0 and by_step[4]["fleet/restarts"] == 1.0
    replacement = (tmp_path / "fake2.log").read_text()
    assert "request /update_weights" in replacement and "request /inference/v1/generate" in replacement
    # every version on both servers: versions 0-3 (step 4's weights are pushed after the last rollout too)
    assert (tmp_path / "fake1.log").read_text().count("request /finish_weight_update") == 5


def test_a_listed_vllm_fleet_trains_at_staleness_one_with_every_version_on_both_servers(
    tmp_path, monkeypatch
):
    """``rollout.server_url`` two FAKE servers, ``rollout.max_staleness=1``: the pipeline's producer
    generates through the fleet while the trainer trains; every step trains, each batch at most
    one version behind, both servers share the requests and load every version the producer asks
    for. Planted: ``Fleet.load_weights`` loading the first serving engine only → server 1 never
    loads after the first version."""
    import dataclasses
    import json

    from grpo_fast.rollout import registry
    from grpo_fast.rollout.vllm.transfer.transport import free_port

    spec = registry.backends()["vllm"]  # attached servers need no vLLM here
    monkeypatch.setitem(registry.backends(), "vllm", dataclasses.replace(spec, missing=lambda: None))
    ports = [free_port(), free_port()]
    procs = [_fake_server(p, tmp_path / f"fake{i}.log") for i, p in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        out = tmp_path / "run"
        args = [*VLLM_RUN, "rollout.max_staleness=1", "rollout.old_logprobs=sampler"]
        assert main([*args, f"rollout.server_url=[{urls[0]},{urls[1]}]", f"output_dir={out}"]) == 0
    finally:
        for p in procs:
            p.kill()
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert max(r["rollout/policy_lag"] for r in steps) <= 1.0
    assert all(r["fleet/engines_serving"] == 2.0 for r in steps)
    assert (
        sum(r["fleet/engine0/requests"] for r in steps)
        == sum(r["fleet/engine1/requests"] for r in steps)
        == 4
    )
    loads = [(tmp_path / f"fake{i}.log").read_text().count("request /finish_weight_update") for i in (0, 1)]
    assert loads[0] == loads[1] >= 4, loads  # version 0, then each version the producer generated with
