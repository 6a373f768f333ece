"""The vLLM backend's orchestration, on CPU, against a FAKE engine at the ``Engine`` boundary.

``FakeVLLMEngine`` is not vLLM: it is a clearly labelled stand-in with the methods of
``grpo_fast.rollout.vllm.placement.colocated.VLLMEngine`` (generate / prompt_logprobs /
load_weights / wake_up / reset_prefix_cache / sleep). It keeps its own copy of the weights (filled only through
``load_weights``, by Hugging Face names, like vLLM), refuses to generate while asleep or before a
push, and samples with transformers. The real engine runs in tests/test_vllm_engine.py.
"""

import copy
import json
import math
import re
import time
from dataclasses import replace

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.sampler_correction import sampler_importance_weights
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.loop.optimization import prepare_old_and_ref
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import build_policy_loss
from grpo_fast.rollout import Rollout
from grpo_fast.rollout.base import BackendContext, SamplingParams, sync_weights
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.rollout.sampling import step_seed
from grpo_fast.rollout.vllm import VLLMBackend, WeightSyncError, WeightSyncProbe
from grpo_fast.task import tiny
from grpo_fast.train import run


class FakeVLLMEngine:
    """FAKE vLLM engine for CPU tests (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer, supports_sleep: bool = True):
        self.model = copy.deepcopy(model).eval()
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))  # nothing valid until weights are pushed
        self.tokenizer = tokenizer
        self.supports_sleep = supports_sleep
        self.awake = {"weights": True, "kv_cache": True}
        self.calls: list[str] = []
        self.pushed_versions = 0
        self.drop_pushes = False  # simulate an engine that keeps serving stale weights
        self.sources: list = []  # what each load_weights was given

    def load_weights(self, named_tensors, version=None):
        assert self.awake["weights"], "load_weights while the weights are asleep"
        self.sources.append(named_tensors)
        own = self.model.state_dict()
        for name, t in named_tensors:
            if not self.drop_pushes:
                own[name].copy_(t.to(own[name].dtype))
        self.pushed_versions += 1
        self.calls.append("load_weights")

    def wake_up(self, tags):
        for t in tags:
            self.awake[t] = True
        self.calls.append(f"wake_up({','.join(tags)})")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        assert self.supports_sleep, "sleep on a platform without sleep mode"
        self.awake = {"weights": False, "kv_cache": False}
        self.calls.append(f"sleep({level})")

    def generate(self, prompt_ids, params: SamplingParams | list[SamplingParams]):
        if not isinstance(params, SamplingParams):  # one request each (multi-turn continuations)
            return [self.generate([p], q)[0] for p, q in zip(prompt_ids, params)]
        assert all(self.awake.values()), f"generate while asleep: {self.awake}"
        assert all(torch.isfinite(p).all() for p in self.model.parameters()), (
            "generate before any weight push"
        )
        self.calls.append("generate")
        if params.seed is not None:
            torch.manual_seed(params.seed)
        rollout = HFBackend(self.model, self.tokenizer, generation_batch_size=256).generate(
            prompt_ids, params
        )
        groups, k = [], 0
        for p in prompt_ids:
            group = []
            for _ in range(params.n):
                ids = rollout.response_ids[k]
                group.append(
                    {
                        "token_ids": ids,
                        "text": rollout.response_text[k],
                        "finish_reason": rollout.finish_reason[k],
                        "logprobs": self._logprobs(list(p) + list(ids), len(p), params.temperature),
                    }
                )
                k += 1
            groups.append(group)
        return groups

    def prompt_logprobs(self, token_ids):
        return self._logprobs(list(token_ids), 1, 1.0)

    @torch.no_grad()
    def _logprobs(self, seq, n_prompt, temperature):
        logits = self.model(torch.tensor([seq])).logits[0, n_prompt - 1 : -1].double() / max(
            temperature, 1e-6
        )
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[n_prompt:])[:, None])[:, 0].tolist()


def _tiny():
    tok = tiny.build_tokenizer()
    return tok, tiny.build_model(tok, seed=0)


PARAMS = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=3, min_tokens=0)


def test_orchestration_order_and_weight_push():
    tok, model = _tiny()
    engine = FakeVLLMEngine(model, tok)
    backend = VLLMBackend(engine, tok, sleep_level=1)
    with pytest.raises(RuntimeError, match="before any load_weights"):
        backend.generate([[3, 4]], PARAMS)
    backend.update_weights(model)
    prompts = [tok("12+34=")["input_ids"], tok("5+5=")["input_ids"]]
    out = backend.generate(prompts, PARAMS)
    backend.sleep()
    assert engine.calls == ["load_weights", "reset_prefix_cache", "generate", "sleep(1)"]
    assert len(out.response_ids) == 4 and out.sampler_logprobs is not None
    assert [len(x) for x in out.sampler_logprobs] == [len(x) for x in out.response_ids]

    with torch.no_grad():  # the trainer takes a step...
        for p in model.parameters():
            p.add_(0.01)
    engine.calls.clear()
    backend.update_weights(model, step=1)  # ...the push wakes the weights first...
    backend.generate(prompts, PARAMS)  # ...and the rollout wakes the KV cache
    assert engine.calls == [
        "wake_up(weights)",
        "load_weights",
        "reset_prefix_cache",
        "wake_up(kv_cache)",
        "generate",
    ]
    for (name, a), b in zip(model.state_dict().items(), engine.model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_vllm_backend_keeps_each_response_with_its_prompt():
    """The engine's groups (one list of n completions per prompt) become the rollout's responses
    in prompt order: with a policy answering the prompt its cache holds (tests/answer_oracle.py:
    right on a group's even samples, ten times that on the odd ones), every response graded against
    its own prompt's answer earns the tiny reward exactly on the even samples."""
    import answer_oracle

    tok = tiny.build_tokenizer()
    model = answer_oracle.AnswerModel(tok)  # the engine serves a copy of it, once pushed
    backend = VLLMBackend(FakeVLLMEngine(model, tok), tok, sleep_level=1)
    backend.update_weights(model)
    questions = ["12+34=", "5+7=", "60+21=", "9+9="]
    out = backend.generate([tok(q)["input_ids"] for q in questions], replace(PARAMS, n=3, max_tokens=4))
    answer_oracle.check_grouped(out, questions, 3, tok)


def test_no_sleep_mode_on_the_platform_keeps_the_engine_awake():
    tok, model = _tiny()
    engine = FakeVLLMEngine(model, tok, supports_sleep=False)
    backend = VLLMBackend(engine, tok, sleep_level=1)
    backend.update_weights(model)
    backend.generate([[3, 4]], PARAMS)
    backend.sleep()  # nothing to do: the fake engine asserts it is never called
    backend.update_weights(model, step=1)
    backend.generate([[3, 4]], PARAMS)
    assert engine.calls == ["load_weights", "reset_prefix_cache", "generate"] * 2


def test_level_two_sleep_without_a_push_is_an_error():
    tok, model = _tiny()
    backend = VLLMBackend(FakeVLLMEngine(model, tok), tok, sleep_level=2)
    backend.update_weights(model)
    backend.generate([[3, 4]], PARAMS)
    backend.sleep()
    with pytest.raises(RuntimeError, match="level 2"):
        backend.generate([[3, 4]], PARAMS)
    backend.update_weights(model, step=1)  # a push refills the discarded weights
    backend.generate([[3, 4]], PARAMS)


def _probe_for(model, tok, tolerance=1e-3):
    cfg = load_config("tiny", check_device=False)
    loss = build_policy_loss(cfg, model, None)

    def trainer_logprobs(ids):
        from grpo_fast.policy.batch import Sequence

        mb = make_microbatches([Sequence(list(ids), 1, 0.0, 0.0)], 1, tok.pad_token_id, packing=False)[0]
        with torch.no_grad():
            return loss(mb, LossOptions(), 1.0).logprobs

    return WeightSyncProbe(tok("37+45=82")["input_ids"], trainer_logprobs, tolerance)


def test_weight_sync_probe_passes_a_real_push_and_stops_on_stale_weights():
    tok, model = _tiny()
    engine = FakeVLLMEngine(model, tok)
    backend = VLLMBackend(engine, tok, probe=_probe_for(model, tok))
    backend.update_weights(model, step=0)
    assert backend.calls == ["load_weights", "reset_prefix_cache", "probe"]
    # the fused op (trainer) and transformers' forward (fake engine) agree to fp32 rounding
    assert backend.weight_sync_abs_diff < 1e-5
    engine.drop_pushes = True  # from now on vLLM keeps serving the step-0 weights
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    with pytest.raises(WeightSyncError, match=r"step 7: vLLM is not serving the pushed weights"):
        backend.update_weights(model, step=7)
    assert backend.weight_sync_abs_diff > 1e-3


def test_host_copies_keep_each_temporary_s_value_and_leave_a_tied_head_out():
    """Host copies of tensors made one at a time (a gathered FSDP tensor, a merged LoRA weight),
    each where the last one was, keep their own values; ``tied_names`` finds the tied head by the model's own parameters, and the copies
    leave it out. Planted: the dedupe by address (before the fix) → w1… are w0's copy."""
    from grpo_fast.rollout.vllm import hf_named_tensors, host_copies, tied_names

    def made():  # each tensor where the last one was (a gather's reused buffer)
        buffer = torch.empty(64, 64)
        for i in range(8):
            yield f"w{i}", buffer.fill_(float(i))

    copies = host_copies(made())
    assert all(torch.equal(copies[f"w{i}"], torch.full((64, 64), float(i))) for i in range(8))
    _, model = _tiny()
    ties = tied_names(model)
    assert ties == {"lm_head.weight": "model.embed_tokens.weight"}
    staged = host_copies(hf_named_tensors(model), ties)
    assert set(staged) == set(model.state_dict()) - {"lm_head.weight"}


def test_a_staged_version_is_pushed_and_probed_as_it_was_when_staged():
    """``stage`` copies the weights and the probe's reference log-probs at once; the trainer then
    moves on, and ``load_weights`` pushes the copy (not the live model) and probes it against the
    staged reference: the engine serves version 1 exactly and the probe passes. Planted: a stage
    that keeps views (no copy) or a probe against the live model → the engine's weights differ
    from the staged ones / the probe fails. An engine that drops the push still stops the run."""
    tok, model = _tiny()
    engine = FakeVLLMEngine(model, tok)
    backend = VLLMBackend(engine, tok, probe=_probe_for(model, tok))
    backend.update_weights(model, step=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)  # version 1
    staged = backend.stage(model)
    version1 = {n: t.clone() for n, t in model.state_dict().items()}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    names = [n for n in staged["tensors"] if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    if tied and len(names) == 2:  # a tied head stays one copy
        assert staged["tensors"][names[0]] is staged["tensors"][names[1]]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)  # the trainer's next step, before the producer loads version 1
    engine.calls.clear()
    backend.load_weights(staged, 1)
    assert engine.calls == ["load_weights", "reset_prefix_cache"]
    assert backend.policy_version == 1 and backend.weight_sync_abs_diff < 1e-5
    served = engine.model.state_dict()
    assert all(torch.equal(served[n], version1[n]) for n in version1)
    engine.drop_pushes = True
    staged2 = backend.stage(model)
    with pytest.raises(WeightSyncError, match=r"step 2: vLLM is not serving the pushed weights"):
        backend.load_weights(staged2, 2)


def test_step_seed_is_reproducible_and_differs_by_step_and_rank():
    assert step_seed(0, 5, 0) == step_seed(0, 5, 0)
    seeds = {step_seed(s, t, r) for s in (0, 1) for t in range(1, 50) for r in range(4)}
    assert len(seeds) == 2 * 49 * 4 and max(seeds) < 2**31


# ---- truncated importance sampling against the sampler (hand-worked)


def _weights(delta, seq, level, mode, cap=2.0):
    trainer = torch.tensor([-1.0] * len(delta))
    sampler = trainer - torch.tensor(delta)
    return sampler_importance_weights(
        trainer, sampler, torch.tensor(seq), level=level, mode=mode, cap=cap
    ).tolist()


def test_token_level_weights_truncate_and_mask():
    d = [0.0, math.log(3), -math.log(2)]  # ρ = [1, 3, 0.5]
    assert _weights(d, [0, 0, 1], "token", "truncate") == pytest.approx([1.0, 2.0, 0.5])  # 3 > cap 2 → 2
    assert _weights(d, [0, 0, 1], "token", "mask") == pytest.approx([1.0, 0.0, 0.5])  # 3 > cap 2 → 0


def test_sequence_level_weights_use_the_product_over_the_response():
    # sequence 0: ρ = e^(ln 1.5 + ln 1.2) = 1.8 ≤ 2 on both tokens; sequence 1: e^(ln 3) = 3 > 2
    d = [math.log(1.5), math.log(1.2), math.log(3)]
    assert _weights(d, [4, 4, 9], "sequence", "truncate") == pytest.approx([1.8, 1.8, 2.0])
    assert _weights(d, [4, 4, 9], "sequence", "mask") == pytest.approx([1.8, 1.8, 0.0])


def _microbatch_with_sampler_gap(model, tok, delta: float):
    """One microbatch of two responses whose sampler log-probs are the trainer's minus ``delta``."""
    prompts = [tok("12+34=")["input_ids"]]
    responses = [tok("46")["input_ids"], tok("5")["input_ids"]]
    seqs = loss_trajectories(
        Rollout(prompts, responses),
        advantages=torch.tensor([1.0, -1.0]),
        length_norm="sequence_mean",
        max_length=4,
    )
    mb = make_microbatches(seqs, 8, tok.pad_token_id, packing=False)[0]
    cfg = load_config("tiny", check_device=False)
    with torch.no_grad():
        trainer = build_policy_loss(cfg, model, None)(mb, LossOptions(), 1.0).logprobs
    mb.sampler_logprobs = trainer - delta
    return mb


@pytest.mark.parametrize(
    ("level", "mode", "factor"),
    [
        ("token", "truncate", math.exp(0.5)),  # ρ = e^0.5 ≈ 1.65 < cap 2 on every token
        ("token", "mask", math.exp(0.5)),
        ("sequence", "truncate", None),  # 2-token response: e^1.0 ≈ 2.72 → 2; 1-token: e^0.5
        ("sequence", "mask", None),  # 2-token response masked (2.72 > 2); 1-token: e^0.5
    ],
)
def test_correction_rescales_the_loss_weights_by_the_expected_amounts(level, mode, factor):
    tok, model = _tiny()
    mb = _microbatch_with_sampler_gap(model, tok, 0.5)
    before = mb.loss_weights.clone()
    cfg = load_config(
        "tiny",
        overrides=[
            "rollout.backend=vllm",
            "rollout.is_correction=true",
            f"rollout.is_level={level}",
            f"rollout.is_mode={mode}",
        ],
        check_device=False,
    )
    [weighted], extra = prepare_old_and_ref(
        cfg, [mb], build_policy_loss(cfg, model, None), None, 1.0, LossOptions()
    )
    assert torch.equal(mb.loss_weights, before)  # a new microbatch: the given one is left as it was
    ratio = (weighted.loss_weights / before).tolist()
    if factor is not None:
        expected = [factor] * len(ratio)
    else:  # longest sequence first: tokens 0-1 belong to "46", token 2 to "5"
        long = 2.0 if mode == "truncate" else 0.0
        expected = [long, long, math.exp(0.5)]
    assert ratio == pytest.approx(expected, rel=1e-5)
    assert extra["rollout/is_weight_mean"] == pytest.approx(sum(expected) / 3, rel=1e-5)


def test_old_logprobs_from_the_sampler_skip_the_no_grad_pass():
    tok, model = _tiny()
    mb = _microbatch_with_sampler_gap(model, tok, 0.25)
    calls = []
    cfg = load_config(
        "tiny",
        overrides=[
            "rollout.backend=vllm",
            "rollout.old_logprobs=sampler",
            "train.epochs_per_rollout_batch=2",
        ],
        check_device=False,
    )
    loss = build_policy_loss(cfg, model, None)
    loss.register_forward_hook(lambda *a: calls.append(1))
    [new], _ = prepare_old_and_ref(cfg, [mb], loss, None, 1.0, LossOptions())
    assert calls == [] and torch.equal(new.old_logprobs, new.sampler_logprobs) and mb.old_logprobs is None
    cfg = load_config(
        "tiny", overrides=["train.epochs_per_rollout_batch=2"], check_device=False
    )  # old_logprobs=trainer (default): one no-grad pass
    [new], _ = prepare_old_and_ref(cfg, [mb], loss, None, 1.0, LossOptions())
    assert calls == [1] and not torch.equal(new.old_logprobs, new.sampler_logprobs)


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_first_epoch_ratio_is_exactly_one(amp):
    """π_old from a no-grad pass of the same fused module: the grad forward's log-probs equal it
    bitwise, so exp(log π − log π_old) = 1 on every token (fp32, and under CPU bf16 autocast, the
    path the GPU presets run)."""
    tok, model = _tiny()
    prompts = [tok("12+34=")["input_ids"], tok("7+8=")["input_ids"]]
    responses = [tok(x)["input_ids"] for x in ("46", "4", "15", "151")]
    seqs = loss_trajectories(
        Rollout(prompts, responses),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        length_norm="sequence_mean",
        max_length=4,
    )
    mbs = make_microbatches(seqs, 2, tok.pad_token_id, packing=False)
    cfg = load_config("tiny", overrides=["train.epochs_per_rollout_batch=2"], check_device=False)
    loss = build_policy_loss(cfg, model, amp)
    mbs, _ = prepare_old_and_ref(cfg, mbs, loss, None, 0.7, LossOptions())
    for mb in mbs:
        out = loss(mb, LossOptions(), 0.7)
        assert torch.equal(out.logprobs, mb.old_logprobs)
        assert not out.clipped.any()
        out.loss.backward()


def test_sampler_options_need_a_backend_that_returns_sampler_log_probs(monkeypatch):
    """rollout.is_correction and rollout.old_logprobs=sampler need the sampler's log-probs: both
    backends return them (hf from its own decoding), so both are accepted; a backend that did not
    (planted: hf's capability off in the registry) is refused in one line naming one that does."""
    import dataclasses

    from grpo_fast.rollout import registry

    keys = ("rollout.is_correction=true", "rollout.old_logprobs=sampler")
    for key in keys:
        load_config("tiny", overrides=[key, "train.epochs_per_rollout_batch=2"], check_device=False)
    found = dict(registry.backends())
    monkeypatch.setattr(
        registry, "_FOUND", {**found, "hf": dataclasses.replace(found["hf"], sampler_logprobs=False)}
    )
    for key in keys:
        with pytest.raises(
            ConfigError, match=re.escape("rollout.backend=hf does not return: use rollout.backend=vllm")
        ):
            load_config("tiny", overrides=[key], check_device=False)


def test_vllm_kwargs_pass_through_but_not_the_managed_ones():
    cfg = load_config("tiny", overrides=["rollout.vllm_kwargs.max_num_seqs=64"], check_device=False)
    assert cfg.rollout.vllm_kwargs == {"enforce_eager": True, "max_num_seqs": 64}
    with pytest.raises(
        ConfigError, match=r"rollout\.vllm_kwargs\.seed is set by grpo_fast itself \(from seed\)"
    ):
        load_config("tiny", overrides=["rollout.vllm_kwargs.seed=3"], check_device=False)


def test_vllm_backend_without_vllm_installed_is_one_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="needs vLLM: pip install"):
        load_config("tiny", overrides=["rollout.backend=vllm"])


@pytest.mark.slow
def test_training_loop_with_the_fake_engine_and_mismatch_correction(tmp_path):
    """The whole loop on the vllm backend (fake engine): the policy is pushed before the first
    rollout and after every step, the probe and the trainer/sampler gap are ≈ 0 (both fp32)."""
    cfg = load_config(
        "tiny",
        overrides=[
            f"output_dir={tmp_path}",
            "steps=3",
            "sft.steps=20",
            "eval_every=0",
            "checkpoint_every=0",
            "rollout.backend=vllm",
            "rollout.is_correction=true",
            "rollout.batch_size=32",
        ],
        check_device=False,
    )
    tok = tiny.build_tokenizer()
    engine = FakeVLLMEngine(tiny.build_model(tok, seed=0), tok)
    run(cfg, engine=engine)
    assert engine.pushed_versions == 1 + 3  # the warm-started policy, then one push per step
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 3
    assert max(r["rollout/logprob_abs_diff"] for r in steps) < 1e-4
    assert max(r["rollout/weight_sync_abs_diff"] for r in steps) < 1e-5
    assert all(r["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-4) for r in steps)


def test_stale_engine_stops_the_run(tmp_path):
    """An engine that silently ignores pushes: the first push after the warm start already fails
    the probe (vLLM still serves random weights). ``WeightSyncError`` is a ``UserError``: the CLI
    prints it as one line and exits 2."""
    tok = tiny.build_tokenizer()
    engine = FakeVLLMEngine(tiny.build_model(tok, seed=1), tok)
    engine.drop_pushes = True
    with torch.no_grad():  # what the engine serves: a random model of the same shape
        for (_, own), (_, p) in zip(
            engine.model.named_parameters(), tiny.build_model(tok, seed=1).named_parameters()
        ):
            own.copy_(p)
    cfg = load_config(
        "tiny",
        overrides=[
            f"output_dir={tmp_path}",
            "steps=2",
            "sft.steps=20",
            "eval_every=0",
            "rollout.backend=vllm",
        ],
        check_device=False,
    )
    with pytest.raises(WeightSyncError, match="step 0: vLLM is not serving the pushed weights"):
        run(cfg, engine=engine)


def test_a_vllm_fleet_loads_every_engine_probes_each_and_replaces_one_serving_stale_weights():
    """``grpo_fast.rollout.vllm.fleet`` over two FAKE engines: a version staged once reaches both
    (each probed; the fleet's ``weight_sync_abs_diff`` is the worst engine's); an engine that
    keeps its old weights fails its probe on the next version, is out of service (one warning
    line), and a fresh engine takes its place, loaded with the version the fleet serves and
    probed. Each version is written once (``StagedShm``) and every engine, the restarted one too,
    loads those files; the previous version's go when the next is written, the last with the
    fleet. Planted: the fleet's load skipping the member's probe → the stale engine stays in
    service; the fleet's ``share`` handing on the host copies → no ``StagedShm``; the previous
    version's files kept → its folder still there."""
    from grpo_fast.rollout.vllm.fleet import vllm_fleet
    from grpo_fast.rollout.vllm.transfer.transport import StagedShm

    tok, model = _tiny()
    cfg = load_config(
        "tiny", overrides=["rollout.backend=vllm", "rollout.placement=server", "rollout.num_engines=2"],
        check_device=False,
    )  # fmt: skip
    engines, lines = [], []

    def start(i):
        engines.append((i, FakeVLLMEngine(model, tok, supports_sleep=False)))
        return engines[-1][1]

    ctx = BackendContext(
        cfg, model, tok, torch.device("cpu"), probe=_probe_for(model, tok), warn=lines.append
    )
    fleet = vllm_fleet(ctx, "unused", "float32", 0, None, VLLMBackend, start_engine=start)
    sync_weights(fleet, model, 0)
    assert [e.pushed_versions for _, e in engines] == [1, 1] and fleet.weight_sync_abs_diff < 1e-5
    v0 = engines[0][1].sources[-1]
    assert isinstance(v0, StagedShm) and engines[1][1].sources[-1] is v0 and v0.dir.is_dir()
    next(e for i, e in engines if i == 1).drop_pushes = True  # engine 1 keeps serving version 0 (the
    # engines start in threads of their own: in either order)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sync_weights(fleet, model, 1)
    assert lines[0].startswith(
        "warning: vLLM server 1 out of service (step 1: vLLM is not serving the pushed weights"
    )
    _wait_for = time.monotonic() + 30
    while len(fleet.serving) < 2:
        assert time.monotonic() < _wait_for
        time.sleep(0.01)
    assert sorted(i for i, _ in engines[:2]) == [0, 1] and engines[2][0] == 1  # engine 1 started again
    assert engines[2][1].pushed_versions == 1 and fleet.serving[1].backend.policy_version == 1
    assert fleet.weight_sync_abs_diff < 1e-5
    v1 = engines[0][1].sources[-1]
    assert isinstance(v1, StagedShm) and v1 is not v0 and not v0.dir.exists()
    assert [e.sources[-1] for _, e in engines] == [v1, v1, v1]
    out = fleet.generate([[3, 4], [5, 6]], PARAMS)
    assert len(out.groups) == 2
    fleet.close()
    assert not v1.dir.exists()
