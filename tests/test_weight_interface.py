"""Weights leave the trainer one way (``grpo_fast.rollout.base.RolloutBackend``): ``stage`` then
``load_weights``, for lockstep (at once, ``keep=False``) and the pipeline (staged copies its
producer loads later); every backend declares the whole interface."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from grpo_fast.rollout import RolloutBackend
from grpo_fast.rollout.hf import HFBackend, HFCopyBackend, HFProcessBackend
from grpo_fast.rollout.vllm import VLLMBackend
from grpo_fast.task import tiny
from grpo_fast.train import main

MEMBERS = ("version", "stage", "load_weights", "generate", "sleep", "close")
QUICK = ["--preset", "tiny", "steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0",
         "logging.progress=false", "logging.sample_every=0", "rollout.batch_size=16"]  # fmt: skip


def test_the_protocol_declares_what_the_loop_calls_and_every_backend_has_it():
    """``version`` an attribute (hf: set in ``__init__``) or a property (vllm); the rest methods."""
    assert all(hasattr(RolloutBackend, m) for m in MEMBERS)
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    for backend in (HFBackend(model, tok, 8), HFCopyBackend(model, tok, 8)):
        assert [m for m in MEMBERS if not hasattr(backend, m)] == [], type(backend).__name__
    for cls in (HFProcessBackend, VLLMBackend):
        declared = hasattr(cls, "version") or "self.version =" in inspect.getsource(cls.__init__)
        assert declared and [m for m in MEMBERS[1:] if not hasattr(cls, m)] == [], cls.__name__


def test_a_staged_version_is_a_copy_and_loads_exactly():
    """``stage(keep=True)`` holds the weights as they were (the trainer steps on); ``load_weights``
    serves exactly them as the version given; ``keep=False`` reads the model in place."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    backend = HFCopyBackend(model, tok, generation_batch_size=8)
    staged = backend.stage(model)
    before = {n: t.clone() for n, t in staged.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # the trainer's next step
    assert all(torch.equal(staged[n], before[n]) for n in staged)
    backend.load_weights(staged, 3)
    served = dict(backend.model.named_parameters())
    assert backend.version == 3 and all(torch.equal(served[n], before[n]) for n in before)
    live = backend.stage(model, keep=False)
    assert all(live[n].data_ptr() == p.data_ptr() for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "more, cls, keep, loads",
    [((), HFBackend, False, [1, 2]),
     (("rollout.max_staleness=1", "rollout.old_logprobs=sampler"), HFCopyBackend, True, [0])],
    ids=["lockstep", "staleness-1"],
)  # fmt: skip
def test_both_outlines_publish_by_stage_then_load(tmp_path, monkeypatch, more, cls, keep, loads):
    """Lockstep stages each step's weights to be loaded at once and loads them as that step's
    version; the pipeline stages host copies (versions 0, 1, 2) and its producer loads the one its
    jobs sample with (steps 1 and 2 both from version 0 at staleness 1). Planted: lockstep through
    the backend's own ``update_weights`` (ed0dfd1) → no stage call."""
    calls = []
    stage, load = cls.stage, cls.load_weights

    def staged(self, model, keep=True):
        calls.append(("stage", keep))
        return stage(self, model, keep) if cls is not HFCopyBackend else stage(model, keep)

    def loaded(self, what, version):
        calls.append(("load", version))
        return load(self, what, version)

    monkeypatch.setattr(cls, "stage", staged)
    monkeypatch.setattr(cls, "load_weights", loaded)
    assert main([*QUICK, f"output_dir={tmp_path}", *more]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert [k for what, k in calls if what == "stage"] == [keep] * (2 if not keep else 3)
    assert [v for what, v in calls if what == "load"][: len(loads)] == loads
    if not keep:  # at once: each load right after its stage
        assert calls == [("stage", False), ("load", 1), ("stage", False), ("load", 2)]
