"""On-policy distillation (``distill.*``): the teacher's per-token gap against float64 from full
logits, its pass's memory against an eager ``log_softmax``, the advantages a run trains on, the
keys, the refusals; under staleness 1 and on two ranks."""

import json
from types import SimpleNamespace

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.obs.memory import peak_rss_growth
from grpo_fast.task import tiny
from grpo_fast.task.rewards import register_reward


@register_reward("test_distill_odd_first_digit")
def _odd_first_digit(response: str, ground_truth: str) -> dict[str, float]:
    """A reward an untrained tiny model earns about half the time: varied rewards from step 1."""
    return {"reward": float(response[:1] in ("1", "3", "5", "7", "9"))}


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory):
    """A teacher: the tiny model of another seed, saved with the student's tokenizer."""
    folder = tmp_path_factory.mktemp("teacher")
    tok = tiny.build_tokenizer()
    tiny.build_model(tok, seed=1).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _eager_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature
    logp = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("packing", [False, True])
def test_the_teachers_gap_is_its_logprob_less_the_students_per_token(packing, teacher_folder):
    """``score_responses(teacher=True)``: per response, per sampled token, log π_teacher −
    log π_student at the sampling temperature, equal to float64 from full logits whatever the
    microbatch order or packing."""
    from grpo_fast.loop.optimization import score_responses
    from grpo_fast.policy.loss import PolicyLoss
    from grpo_fast.policy.teacher import load_teacher
    from grpo_fast.rollout import Rollout

    tok = tiny.build_tokenizer()
    student = tiny.build_model(tok, seed=0)
    teacher = load_teacher(
        str(teacher_folder), tok, student.get_output_embeddings().weight.shape[0], torch.float32, "cpu"
    )
    cfg = load_config("tiny", overrides=["train.micro_batch_size=2", f"train.packing={str(packing).lower()}"])
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[10, 11], [12, 13, 14, 3, 4], [2], [6, 7, 8]]
    rollout = Rollout(prompts, responses, ["x"] * 4, ["stop"] * 4)
    run = SimpleNamespace(
        cfg=cfg, device=torch.device("cpu"), tokenizer=tok,
        trainer=SimpleNamespace(
            policy_loss=PolicyLoss(student, autocast=None, backend="torch_chunked"),
            teacher_loss=PolicyLoss(teacher, autocast=None, backend="torch_chunked"),
            scoring_options=LossOptions,
        ),
    )  # fmt: skip
    scores = score_responses(run, rollout, 0.7, kl=False, teacher=True)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    for gap, p, r in zip(scores.distill, rollout.response_prompt_ids(), responses):
        want = _eager_logprobs(teacher, p, r, 0.7) - _eager_logprobs(student, p, r, 0.7)
        assert gap.tolist() == pytest.approx(want.tolist(), rel=1e-4, abs=1e-5)
    assert len({round(float(g.sum()), 3) for g in scores.distill}) == 4  # distinct: a swap would show


def teacher_pass_workload(impl: str, n_seq: int = 8, prompt: int = 16, response: int = 128):
    """The benchmarks' random Qwen2 (``bench/peers/workloads.py``'s ``wide_config`` at 4 layers:
    D 512, V 32,768) as a teacher and a
    microbatch of ``n_seq`` sequences: its no-grad log-probs of the response tokens through the
    fused op (``impl="fused"``, the teacher's pass) or from its full logits and ``log_softmax``
    (``"eager"``). A top-level function: ``peak_rss_growth`` rebuilds it in a fresh process."""
    from transformers import Qwen2ForCausalLM

    from bench.peers.workloads import wide_config
    from grpo_fast.policy.batch import Sequence, make_microbatches
    from grpo_fast.policy.loss import PolicyLoss

    torch.manual_seed(0)
    config = wide_config(layers=4)
    teacher = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    seqs = [Sequence(torch.randint(10, 32000, (prompt + response,), generator=g).tolist(), prompt, 0.0, 1.0)
            for _ in range(n_seq)]  # fmt: skip
    mb = make_microbatches(seqs, n_seq, 0, packing=False)[0]
    loss = PolicyLoss(teacher, autocast=None, backend="torch_chunked")

    def fused():
        with torch.no_grad():
            return loss(mb, LossOptions(), 1.0).logprobs

    def eager():
        with torch.no_grad():
            logits = teacher(mb.input_ids, attention_mask=mb.attention_mask).logits  # [b, L, V]
            logp = logits.log_softmax(-1).flatten(0, 1).index_select(0, mb.select_index)
            return logp.gather(1, mb.labels[:, None])[:, 0]

    return fused if impl == "fused" else eager


@pytest.mark.slow
def test_the_teachers_pass_builds_no_tokens_by_vocab_tensor():
    """1,024 response tokens at V = 32,768 (an fp32 ``[N, V]`` is 128 MiB, the logits of every
    position 144 MiB): the teacher's fused pass grows the resident set by at most 0.4× what full
    logits and their ``log_softmax`` do (each measured in a fresh process). Measured 2026-12-07,
    alone: 76 MiB against 477 MiB (0.16×), the test 12 s.
    Planted: the pass through the eager backend (``[N, V]`` logits) → the ratio is ~1."""
    fused = peak_rss_growth(teacher_pass_workload, "fused")
    eager = peak_rss_growth(teacher_pass_workload, "eager")
    print(f"teacher pass peak RSS growth: fused {fused / 2**20:.0f} MiB, eager {eager / 2**20:.0f} MiB")
    assert fused <= 0.4 * eager, (fused / 2**20, eager / 2**20)


QUICK = ["steps=2", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16", "logging.progress=false",
         "logging.sample_every=0", "sft.steps=0", "data.reward=test_distill_odd_first_digit"]  # fmt: skip


@pytest.fixture
def recorded(monkeypatch):
    """Every step's finalized batch, and the teacher's gaps its finalize computed."""
    from grpo_fast.loop import optimization, pipeline, rollout_phase

    batches, gaps = [], []
    real_finalize, real_scores = rollout_phase.finalize, optimization.score_responses

    def finalize(*args, **kwargs):
        batches.append(real_finalize(*args, **kwargs))
        return batches[-1]

    def score_responses(*args, **kwargs):
        out = real_scores(*args, **kwargs)
        gaps.append(out.distill)
        return out

    monkeypatch.setattr(rollout_phase, "finalize", finalize)
    monkeypatch.setattr(pipeline, "finalize", finalize)
    monkeypatch.setattr(rollout_phase, "score_responses", score_responses)
    return batches, gaps


def _run(out, teacher, *extra):
    from grpo_fast import train as train_mod

    train_mod.run(
        load_config("tiny", overrides=[*QUICK, f"output_dir={out}", f"distill.teacher={teacher}", *extra])
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("extra", "weight", "coef"),
    [(("distill.reward_weight=0",), 0.0, 1.0), (("distill.coef=0.5",), 1.0, 0.5),
     (("distill.coef=0.5", "rollout.max_staleness=1", "rollout.old_logprobs=sampler"), 1.0, 0.5),
     (("distill.reward_weight=0", "model.lora.r=8"), 0.0, 1.0)],
    ids=["pure", "beside-grpo", "staleness-1", "lora-student"],
)  # fmt: skip
def test_each_token_trains_on_the_teachers_gap(tmp_path, teacher_folder, recorded, extra, weight, coef):
    """Each step's tokens carry ``reward_weight · A + coef · (log π_teacher − log π_student)``: with
    reward_weight 0 the gap alone (pure distillation), beside GRPO's group advantage, in the
    pipeline, and for a LoRA student; ``distill/reverse_kl`` is the mean of −gap over the tokens."""
    from grpo_fast.algo.advantages import normalize_group_rewards

    rows = _run(tmp_path, teacher_folder, *extra)
    batches, gaps = recorded
    assert len(batches) == len(gaps) == 2
    for batch, gap, row in zip(batches, gaps, rows):
        a, _ = normalize_group_rewards(batch.raw_rewards, batch.rollout.sizes, 1e-6, scale_rewards="group")
        for t, adv, g in zip(batch.rollout.trajectories, a.tolist(), gap):
            torch.testing.assert_close(t.token_advantages, weight * adv + coef * g)
        every = torch.cat(gap).double()
        assert row["distill/reverse_kl"] == pytest.approx(-every.mean().item(), rel=1e-6)
        assert row["distill/reverse_kl"] > 0.01 and row["time/teacher_s"] > 0  # another seed: apart
        assert row["time/teacher_share"] == pytest.approx(row["time/teacher_s"] / row["time/step_s"])
        assert 0 < row["time/teacher_share"] < 1
        # the teacher's own peak, and the step's peak still holds the phases around it
        assert 0 < row["memory/teacher_peak_gb"] <= row["memory/peak_gb"]


def test_distill_keys_without_a_teacher_are_one_line():
    with pytest.raises(
        ConfigError, match=r"^distill\.coef configures on-policy distillation; set distill\.teacher$"
    ):
        load_config("tiny", overrides=["distill.coef=2"])


def test_a_teacher_with_another_vocabulary_is_one_line(tmp_path):
    """A tokenizer with one token more: the dry run and the run (before the warm start) refuse it
    with the same line, naming the difference. (A missing or built-in teacher:
    tests/test_dry_run_refuses.py.)"""
    from support.inprocess import one_error_line, run_main

    tok = tiny.build_tokenizer()
    tiny.build_model(tok, seed=1).save_pretrained(tmp_path / "teacher")
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(tmp_path / "teacher")
    args = ["--preset", "tiny", f"output_dir={tmp_path / 'out'}", f"distill.teacher={tmp_path / 'teacher'}"]
    line = one_error_line(run_main(args))
    assert "its tokenizer differs from the student's" in line and "<extra>" in line, line
    assert one_error_line(run_main([*args, "--dry-run"])) == line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_two_ranks_distill(tmp_path, teacher_folder):
    """Data parallel: each rank's teacher scores its own responses; ``distill/reverse_kl`` is over
    every rank's tokens; the run ends."""
    from support.ranks import main_on_ranks

    args = ["--preset", "tiny", *QUICK, f"output_dir={tmp_path / 'out'}", f"distill.teacher={teacher_folder}"]
    args = [a for a in args if not a.startswith("data.reward=")]  # a spawned rank has no test reward
    codes = main_on_ranks(args, tmp_path / "ranks")
    assert [c["code"] for c in codes] == [0, 0], codes
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["world_size"] == 2 and rows[-1]["distill/reverse_kl"] > 0.01


def test_a_4bit_teacher_scores_close_to_its_full_precision_self(teacher_folder):
    """``distill.load_in_4bit``: the teacher's linear layers in NF4 (its lm_head as loaded); its
    per-token log-probs of the same tokens differ from the fp32 teacher's (the 4-bit path ran) by
    NF4's rounding, well under the distance to another model (the student: another seed)."""
    import bitsandbytes as bnb

    from grpo_fast.policy.batch import Sequence, make_microbatches
    from grpo_fast.policy.loss import PolicyLoss
    from grpo_fast.policy.teacher import load_teacher

    tok = tiny.build_tokenizer()
    student = tiny.build_model(tok, seed=0)
    rows = student.get_output_embeddings().weight.shape[0]
    full = load_teacher(str(teacher_folder), tok, rows, torch.float32, "cpu")
    nf4 = load_teacher(str(teacher_folder), tok, rows, torch.float32, "cpu", load_in_4bit=True)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in nf4.modules())
    seqs = [Sequence([5, 6, 7, 10, 11, 12, 13], 3, 0.0, 1.0), Sequence([8, 9, 14, 3, 4, 2], 2, 0.0, 1.0)]
    mb = make_microbatches(seqs, 2, tok.pad_token_id, packing=False)[0]
    with torch.no_grad():
        a, b, c = (
            PolicyLoss(m, autocast=None, backend="torch_chunked")(mb, LossOptions(), 1.0).logprobs
            for m in (full, nf4, student)
        )
    rounding, other = (a - b).abs().mean().item(), (a - c).abs().mean().item()
    print(f"mean |Δ log p|: NF4 teacher {rounding:.4f}, another model {other:.4f}")
    assert 0 < rounding < 0.5 * other, (rounding, other)


def test_the_run_loads_the_teacher_in_4bit_when_asked(tmp_path, teacher_folder, monkeypatch, recorded):
    """``distill.load_in_4bit=true`` reaches the run's teacher (NF4 linear layers) and the run
    trains on its gap."""
    import bitsandbytes as bnb

    from grpo_fast.loop import setup as setup_mod

    loaded, real = [], setup_mod.load_teacher
    monkeypatch.setattr(setup_mod, "load_teacher", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    rows = _run(tmp_path, teacher_folder, "distill.load_in_4bit=true", "distill.reward_weight=0", "steps=1")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in loaded[0].modules())
    batch, gaps = recorded[0][0], recorded[1][0]
    for t, g in zip(batch.rollout.trajectories, gaps):
        torch.testing.assert_close(t.token_advantages, g)
    assert rows[-1]["distill/reverse_kl"] > 0.01


_PEAK_CHECK = """
import json, torch
from grpo_fast.obs.metrics import peak_memory_gb, phase_peak_gb, reset_peak_memory
cpu = torch.device("cpu")
reset_peak_memory(cpu)
before = peak_memory_gb(cpu)
big = torch.ones(100_000_000)  # 400 MB, touched
del big
total, phase = phase_peak_gb(cpu, torch.ones(1000).sum)
print(json.dumps({"total": float(total), "phase": phase, "before": before, "after": peak_memory_gb(cpu)}))
"""


def test_the_teachers_peak_is_its_own_and_the_steps_peak_keeps_what_came_before():
    """``phase_peak_gb`` (``memory/teacher_peak_gb``) resets the peak counter for its phase and
    carries what it held into ``memory/peak_gb``: a 400 MB tensor freed before a small phase is
    in the step's peak, not in the phase's. Planted: the carry left out → the step's peak loses it.
    Measured in a fresh process: the measure is the process's resident memory, which another
    thread of an earlier test freeing memory during it took down by more than the 400 MB (twice:
    beside a busy loop, and in CI at 2.09 GB of a worker's RSS), so the peak stayed at ``before``."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _PEAK_CHECK], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["total"] == 1000
    assert got["after"] >= got["before"] + 0.35, got
    assert got["phase"] < got["before"] + 0.2, got


# -- the teacher served by vLLM (distill.placement=server) -----------------------------------------


class FakeTeacherServer:
    """FAKE vLLM server serving the teacher at ``folder``: its prompt log-probs computed by the
    model itself in float64 over the whole vocabulary at temperature 1 (what vLLM's
    ``prompt_logprobs`` are), ``/tokenize`` by the teacher's tokenizer, ``max_model_len`` as given."""

    def __init__(self, folder, max_model_len: int = 64, tokenize=None):
        from fake_vllm_server import FakeVLLMServer
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        tok = AutoTokenizer.from_pretrained(folder)
        self.asked: list[list[int]] = []
        outer = self

        class Served(FakeVLLMServer):
            def answer(self, path, body):
                if path == "/v1/models":
                    return {"data": [{"id": str(folder), "max_model_len": max_model_len}]}
                if path == "/tokenize":
                    ids = tok(body["prompt"], add_special_tokens=False)["input_ids"]
                    return {"tokens": ids if tokenize is None else tokenize(ids)}
                if path != "/inference/v1/generate" or body["sampling_params"].get("prompt_logprobs") is None:
                    return super().answer(path, body)
                ids = body["token_ids"]
                outer.asked.append(ids)
                with torch.no_grad():
                    logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
                out = super().answer(path, body)
                out["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": float(logp[i, t]), "rank": 1}} for i, t in enumerate(ids[1:])
                ]
                return out

        self.server = Served()
        self.url = self.server.url

    def __enter__(self):
        self.server.__enter__()
        return self

    def __exit__(self, *exc):
        self.server.__exit__(*exc)


def test_a_served_teacher_gives_the_trained_teacher_s_gaps_and_asks_nothing_of_inserted_tokens(
    tmp_path, teacher_folder, recorded
):
    """``distill.placement=server`` against a FAKE vLLM server computing the teacher's prompt
    log-probs: step 1's per-token gaps (the same tokens: the same seed, the same weights) equal the
    teacher loaded in the trainer's, every response asked once, the teacher's pass costing no
    trainer memory; at staleness 1 too. ``ServedTeacher`` takes a multi-turn response's sampled
    tokens only.
    Planted: the log-prob of position ``P + j`` (one off) → the gaps differ; the inserted tokens
    asked too → the multi-turn count."""
    from grpo_fast.policy.teacher import ServedTeacher
    from grpo_fast.rollout.trajectory import Role, Trajectory

    local = _run(tmp_path / "local", teacher_folder)
    local_gaps = [g.clone() for g in recorded[1][0]]
    recorded[1].clear()
    with FakeTeacherServer(teacher_folder) as fake:
        served = _run(
            tmp_path / "served", teacher_folder, "distill.placement=server", f"distill.server_url={fake.url}"
        )
        first = recorded[1][0]
        assert len(fake.asked) == sum(len(b.rollout.trajectories) for b in recorded[0][-2:])
        assert len(first) == len(local_gaps) and all(
            torch.allclose(a, b, rtol=0, atol=2e-5) for a, b in zip(first, local_gaps)
        )
        assert served[1]["distill/reverse_kl"] == pytest.approx(local[1]["distill/reverse_kl"], rel=1e-4)
        assert served[1]["memory/teacher_peak_gb"] == 0.0 and served[1]["time/teacher_s"] >= 0
        stale = _run(tmp_path / "stale", teacher_folder, "distill.placement=server", f"distill.server_url={fake.url}",
                     "rollout.max_staleness=1", "rollout.old_logprobs=sampler")  # fmt: skip
        assert [r["step"] for r in stale if "distill/reverse_kl" in r] == [
            1,
            2,
        ]  # the pipeline's finalize asks it too
        engine = SimpleNamespace(
            pool=None, prompt_logprobs=lambda ids, doing: [float(i) for i in range(len(ids) - 1)]
        )
        multi = Trajectory(
            [5, 6], [10, 11, 12, 13], roles=[Role.SAMPLED, Role.INSERTED, Role.INSERTED, Role.SAMPLED]
        )
        assert ServedTeacher(engine, "x").logprobs(multi).tolist() == [1.0, 4.0]  # positions 2 and 5 − 1


def test_a_served_teacher_that_cannot_serve_the_run_is_one_line(tmp_path, teacher_folder):
    """Before the first step: a server whose context is shorter than the run's longest sequence,
    or whose tokenizer is not the student's; and the keys a served teacher refuses (a sampling
    distribution vLLM's prompt log-probs are not of, a trainer-side key, a started server's key
    beside a URL, no vLLM for a server the run starts), each one line, the dry run's the run's."""
    from support.inprocess import one_error_line, run_main

    from grpo_fast.rollout.registry import backends

    base = ["--preset", "tiny", *QUICK, f"distill.teacher={teacher_folder}", "distill.placement=server"]
    with FakeTeacherServer(teacher_folder, max_model_len=8) as fake:
        args = [*base, f"distill.server_url={fake.url}", f"output_dir={tmp_path / 'short'}"]
        line = one_error_line(run_main(args))
        assert line == (
            f"error: distill.server_url={fake.url}: the teacher's server holds 8 tokens a sequence, the run's "
            "longest is 20 (rollout.max_prompt_tokens + the longest response): start it with --max-model-len 20 or more"
        )
        assert one_error_line(run_main([*args, "--dry-run"])) == line
    with FakeTeacherServer(teacher_folder, tokenize=lambda ids: [i + 1 for i in ids]) as fake:
        args = [*base, f"distill.server_url={fake.url}", f"output_dir={tmp_path / 'other'}"]
        line = one_error_line(run_main(args))
        assert line.endswith(
            "the teacher's server tokenizes '12+34=46' as [5, 6, 14, 7, 8, 15, 8, 10], the student as "
            "[4, 5, 13, 6, 7, 14, 7, 9]: it must serve distill.teacher (the student's tokenizer and vocabulary)"
        ), line
    assert (
        not (tmp_path / "short" / "metrics.jsonl").exists()
        and not (tmp_path / "other" / "metrics.jsonl").exists()
    )
    refusals = {
        "rollout.temperature=0.7": "and rollout.temperature=0.7 asks the distribution",
        "distill.load_in_4bit=true": "a served teacher's quantization is its server's",
        "distill.devices=[1]": "distill.devices: the server at distill.server_url has its own devices",
    }
    for key, words in refusals.items():
        line = one_error_line(run_main([*base, "distill.server_url=http://127.0.0.1:9", key, "--dry-run"]))
        assert words in line, (key, line)
    trainer_side = one_error_line(run_main(["--preset", "tiny", f"distill.teacher={teacher_folder}",
                                            "distill.server_url=http://127.0.0.1:9", "--dry-run"]))  # fmt: skip
    assert trainer_side == "error: distill.server_url is for a served teacher; set distill.placement=server"
    if backends()["vllm"].missing() is not None:  # this environment (the main one) has no vLLM
        line = one_error_line(run_main([*base, f"output_dir={tmp_path / 'novllm'}"]))
        assert line.startswith(
            "error: distill.placement=server starts a vLLM server for the teacher, and vLLM is not installed here"
        )
        assert one_error_line(run_main([*base, f"output_dir={tmp_path / 'novllm'}", "--dry-run"])) == line
