"""The work both sides of a peer comparison run: one GRPO step of grpo_fast and of TRL's
``GRPOTrainer`` on the same model, prompts and hyperparameters, and the fused-linear loss of
grpo_fast, Liger-Kernel and torch.

Written against TRL 1.16.0, Liger-Kernel 0.8.5, transformers 5.24 and torch 2.13 (read 2026-12-01).

Whole step (``Case``): sequence-mean GRPO (TRL ``loss_type="grpo"``, ours
``loss.length_norm=sequence_mean``), advantages normalized by the group std, β = 0 (no reference
model), one optimizer step per rollout batch (so π_old is never computed by either), AdamW with the
same lr / betas / weight decay, constant LR, gradient clipping at 1.0, fp32, no gradient
checkpointing, both generating with transformers ``generate`` (temperature 1, top-p 1, no top-k).
Both start from copies of one set of weights and take the same prompts in the same order. What
differs is each tool's own design, which is what is measured: grpo_fast skips the forward and
backward of zero-advantage responses, computes each prompt once for its group's responses
(``train.share_prompts``, on by default) and never runs prompt tokens through the lm_head; TRL (on
CPU) repeats the prompt in every sequence and scores every position through its chunked lm_head.

TRL is stepped from outside while its own ``Trainer.train()`` loop runs (``bench/peers/duel.py``
``TRLStepper``): no part of its loop is re-implemented here. All of both tools' compute runs on one
thread (``duel.ComputeThread``), as each tool's would alone in its process.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo_fast import dist
from grpo_fast.algo.course import compute_group_normalized_rewards
from grpo_fast.algo.prompt_sampler import PromptSampler
from grpo_fast.config import Config, load_config, shares_prompts
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import build_policy_loss
from grpo_fast.policy.model import autocast_dtype
from grpo_fast.rollout import Rollout, SamplingParams
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.tools import plan

# Distributions whose versions each peer result records (liger_kernel has no __version__).
VERSIONS = ("torch", "transformers", "trl", "accelerate", "liger-kernel", "triton")


def dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One whole-step comparison: P prompts × G responses per step, ``lr``, and the model/task."""

    name: str
    n_prompts: int
    group_size: int
    max_tokens: int
    min_tokens: int
    lr: float
    warmup_steps: int  # untimed steps of each side before the timed ones
    rounds: int  # timed steps of each side
    describe: str
    prompt_tokens: int = 16  # the random-Qwen2 cases' prompt length
    layers: int = 6  # the random-Qwen2 cases' decoder layers
    overrides: tuple[str, ...] = ()  # grpo_fast's own keys for the case (TRL has no counterpart)

    @property
    def steps(self) -> int:
        """Every step each side takes: warm-up, timed, then one for peak memory and one profiled."""
        return self.warmup_steps + self.rounds + 2

    @property
    def batch(self) -> int:
        return self.n_prompts * self.group_size


TINY = Case(
    name="tiny",
    n_prompts=32,
    group_size=8,
    max_tokens=4,
    min_tokens=0,
    lr=2e-4,
    warmup_steps=3,
    rounds=30,
    describe=(
        "tiny preset, SFT warm-started (sft.target_accuracy=0.25): 32 prompts × 8, ≤ 4 tokens, "
        "lr 2e-4, two-digit addition reward"
    ),
)
# A wider random Qwen2: 6 layers, D = 512, V = 32,768, tied embeddings (≈ 35 M parameters).
WIDE = Case(
    name="qwen2-6L-d512-v32768",
    n_prompts=8,
    group_size=8,
    max_tokens=32,
    min_tokens=32,
    lr=1e-5,
    warmup_steps=1,
    rounds=3,
    describe=(
        "random Qwen2 (6 layers, D 512, V 32,768, tied): 8 prompts of 16 tokens × 8 responses of "
        "exactly 32 tokens, lr 1e-5, reward = share of even token ids"
    ),
)
# Prompt-heavy, as real GRPO work is (a prompt shared by its group's responses, here 2/3 of each
# sequence): a random Qwen2 of 4 layers, D = 512, V = 32,768, tied (≈ 27 M parameters).
PROMPT_HEAVY = Case(
    name="qwen2-4L-d512-v32768-prompt128",
    n_prompts=8,
    group_size=8,
    max_tokens=64,
    min_tokens=64,
    lr=1e-5,
    warmup_steps=1,
    rounds=3,
    describe=(
        "random Qwen2 (4 layers, D 512, V 32,768, tied): 8 prompts of 128 tokens × 8 responses of "
        "exactly 64 tokens, lr 1e-5, reward = share of even token ids"
    ),
    prompt_tokens=128,
    layers=4,
)
# Long responses, where users' runs spend their time (R1-Zero-style reasoning runs sample
# hundreds of tokens a response): the prompt-heavy case's random Qwen2 (4 layers, D 512, V 32,768,
# tied), 4 prompts of 16 tokens × 8 responses of 256 to 512 tokens (random weights rarely sample
# the EOS id: most responses run to 512).
LONG_RESPONSES = Case(
    name="qwen2-4L-d512-v32768-long512",
    n_prompts=4,
    group_size=8,
    max_tokens=512,
    min_tokens=256,
    lr=1e-5,
    warmup_steps=1,
    rounds=3,
    describe=(
        "random Qwen2 (4 layers, D 512, V 32,768, tied): 4 prompts of 16 tokens × 8 responses of "
        "256 to 512 tokens, lr 1e-5, reward = share of even token ids"
    ),
    layers=4,
)
CASES = {c.name: c for c in (TINY, WIDE, PROMPT_HEAVY, LONG_RESPONSES)}
WIDE_VOCAB = 32768


class _Quiet:
    def event(self, msg: str) -> None:
        pass


def tiny_config(case: Case, device: str = "cpu") -> Config:
    """The tiny preset with the comparison's settings (the same values TRL gets in ``trl_args``)."""
    return load_config(
        "tiny",
        overrides=[
            "rollout.backend=hf",
            f"device={device}",
            f"rollout.group_size={case.group_size}",
            f"rollout.batch_size={case.batch}",
            f"rollout.max_tokens={case.max_tokens}",
            f"rollout.min_tokens={case.min_tokens}",
            f"rollout.generation_batch_size={case.batch}",
            f"train.micro_batch_size={case.batch}",
            f"train.lr={case.lr}",
            "train.warmup_steps=0",
            "train.schedule=constant",
            "loss.length_norm=sequence_mean",
            "loss.beta=0.0",
            *case.overrides,
        ],
        check_device=False,
    )


def wide_tokenizer():
    """A word-level tokenizer of ``WIDE_VOCAB`` tokens: ``<pad> <eos> <unk>`` then ``t3 … t32767``
    (token ``t{i}`` has id ``i``), split on whitespace, decoded with spaces."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, WIDE_VOCAB)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", model_max_length=256
    )


def wide_config(layers: int = 6, max_positions: int = 256, pad_id: int = 0, eos_id: int = 1):
    """The random Qwen2 of the wide cases (also bench/workloads_train_step.py's prompt-heavy and
    long-response ones): D 512, MLP 1,536, 8 heads over 2 KV heads, V = ``WIDE_VOCAB``, tied
    embeddings; ``wide_tokenizer``'s pad and EOS ids (EOS also BOS)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=WIDE_VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
    )


def wide_model(tokenizer, seed: int = 0, layers: int = 6, max_positions: int = 256):
    from transformers import Qwen2ForCausalLM

    config = wide_config(layers, max_positions, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def even_token_reward(response: str, ground_truth: str) -> dict[str, float]:
    """Share of the response's tokens ``t{i}`` with an even ``i`` (a dense, learnable reward)."""
    ids = [int(t[1:]) for t in response.split() if t[:1] == "t" and t[1:].isdigit()]
    r = sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


@dataclass
class Problem:
    """What both sides share: the initial weights, tokenizer, prompts in order, reward, eval set."""

    case: Case
    state_dict: dict
    tokenizer: object
    build_model: Callable[[], torch.nn.Module]
    prompts: list[str]  # case.steps · n_prompts prompt texts, in the order both sides take them
    answers: list[str]
    reward_fn: Callable[[str, str], dict[str, float]]
    eval_prompts: list[str] = field(default_factory=list)
    eval_answers: list[str] = field(default_factory=list)
    warm_start_steps: int = 0

    def model(self, device: torch.device) -> torch.nn.Module:
        m = self.build_model()
        m.load_state_dict(self.state_dict)
        m.config.use_cache = False  # training; generate() turns the cache on for itself
        return m.to(device).train()


def make_problem(case_name: str) -> Problem:
    """The case's problem; ``tiny`` runs the preset's SFT warm start first (seconds on an idle
    machine), from the preset's seed."""
    case = CASES[case_name]
    if case.name == TINY.name:
        from grpo_fast.loop.sft import sft_warm_start
        from grpo_fast.policy.model import load_policy, load_tokenizer
        from grpo_fast.task import tiny
        from grpo_fast.task.loader import load_task

        cfg = tiny_config(case)
        tokenizer = load_tokenizer(cfg.model.name_or_path)
        task = load_task(cfg, tokenizer)
        torch.manual_seed(cfg.seed)
        model = load_policy(cfg, tokenizer, torch.device("cpu"))
        sft_steps = sft_warm_start(cfg, model, tokenizer, task, torch.device("cpu"), None, None, _Quiet())
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        sampler = PromptSampler(len(task.train), cfg.seed)
        examples = [task.train[i] for i in sampler.next(case.steps * case.n_prompts)]
        return Problem(
            case=case,
            state_dict=state,
            tokenizer=tokenizer,
            build_model=lambda: tiny.build_model(tokenizer, seed=0),
            prompts=[task.prompt_text(e) for e in examples],
            answers=[e.answer for e in examples],
            reward_fn=task.reward_fn,
            eval_prompts=[task.prompt_text(e) for e in task.eval],
            eval_answers=[e.answer for e in task.eval],
            warm_start_steps=sft_steps,
        )
    tokenizer = wide_tokenizer()
    rng = random.Random(0)
    n = case.steps * case.n_prompts
    prompts = [
        " ".join(f"t{rng.randrange(3, WIDE_VOCAB)}" for _ in range(case.prompt_tokens)) for _ in range(n)
    ]
    positions = max(256, case.prompt_tokens + case.max_tokens)  # RoPE: no weights depend on it
    state = wide_model(tokenizer, layers=case.layers, max_positions=positions).state_dict()
    return Problem(
        case=case,
        state_dict=state,
        tokenizer=tokenizer,
        build_model=lambda: wide_model(tokenizer, layers=case.layers, max_positions=positions),
        prompts=prompts,
        answers=[""] * n,
        reward_fn=even_token_reward,
    )


# ----------------------------------------------------------------------------------------------
# The two steppers: ``step()`` runs one GRPO step and returns its phase times
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepWork:
    """The matmul work a step cannot do without, in tokens: ``gen_tokens`` sampled (one decode
    row each, in batches of ``gen_batch`` rows: the lm_head and every layer), ``prefill_tokens``
    (each prompt once: the layers), ``train_tokens`` through the layers forward and backward
    (the responses that carry a gradient and each of their prompts once) and ``head_tokens``
    through the lm_head forward and backward (those responses' tokens)."""

    gen_tokens: int
    gen_batch: int
    prefill_tokens: int
    train_tokens: int
    head_tokens: int


@dataclass
class StepRecord:
    step_s: float
    rollout_s: float
    train_s: float
    reward: float
    work: StepWork | None = None


class GrpoFastStepper:
    """One step of ``grpo_fast.train``'s loop body, without its logging, evaluation and
    checkpoints: generate (``HFBackend``) → rewards → group advantages → ``loss_trajectories`` →
    drop zero-advantage responses (as the loop does) → microbatches → ``optimize_on_rollout``
    (fused lm_head + loss, backward, clip, AdamW step)."""

    name = "grpo_fast"

    def __init__(self, problem: Problem, device: torch.device):
        from grpo_fast.loop.optimization import optimize_on_rollout, sequences_with_gradient
        from grpo_fast.loop.state import Trainer

        self._with_gradient, self._optimize = sequences_with_gradient, optimize_on_rollout
        case = problem.case
        self.problem, self.device = problem, device
        self.model = problem.model(device)
        cfg = tiny_config(case, device.type)
        self.cfg = cfg = plan.resolve_auto(cfg, self.model.config, device)
        self.amp = autocast_dtype(cfg, device)
        self.backend = HFBackend(self.model, problem.tokenizer, cfg.rollout.generation_batch_size, self.amp)
        self.policy = build_policy_loss(cfg, self.model, self.amp)
        self.optimizer = build_optimizer(cfg, self.model.parameters())
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainer = Trainer(self.policy, self.optimizer, self.params, cfg, dist.DistInfo(), device)
        self.prompt_ids = [
            problem.tokenizer(p, add_special_tokens=False)["input_ids"] for p in problem.prompts
        ]
        self.pos = 0
        self.records: list[StepRecord] = []

    def step(self) -> StepRecord:
        cfg, r, case = self.cfg, self.cfg.rollout, self.problem.case
        t0 = time.perf_counter()
        sl = slice(self.pos, self.pos + case.n_prompts)
        self.pos += case.n_prompts
        params = SamplingParams(
            n=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_tokens,
            min_tokens=r.min_tokens,
        )
        rollout = self.backend.generate(self.prompt_ids[sl], params)
        gts = [a for a in self.problem.answers[sl] for _ in range(r.group_size)]
        advantages, raw, _ = compute_group_normalized_rewards(
            self.problem.reward_fn, rollout.response_text, gts, r.group_size, cfg.loss.advantage_eps, True
        )
        t1 = time.perf_counter()
        lengths = [len(x) for x in rollout.response_ids]
        seqs = loss_trajectories(
            Rollout(rollout.prompt_ids, rollout.response_ids),
            advantages=advantages,
            length_norm=cfg.loss.length_norm,
            max_length=r.max_tokens,
            num_sequences=len(lengths),
            num_tokens=sum(lengths),
        )
        options = cfg.loss.loss_options()
        seqs = self._with_gradient(cfg, seqs, options)
        prompts = {tuple(p) for p in rollout.prompt_ids}  # each prompt once (the decoder prefills it once)
        trained = {tuple(t.prompt_ids) for t in seqs}
        head = sum(len(t.token_ids) for t in seqs)
        work = StepWork(
            gen_tokens=sum(lengths),
            gen_batch=len(lengths),
            prefill_tokens=sum(len(p) for p in prompts),
            train_tokens=head + sum(len(p) for p in trained),
            head_tokens=head,
        )
        mbs = [
            mb.to(self.device)
            for mb in make_microbatches(
                seqs,
                int(cfg.train.micro_batch_size),
                self.problem.tokenizer.pad_token_id,
                cfg.train.packing,
                share_prompts=shares_prompts(cfg),
            )
        ]
        self._optimize(
            self.trainer,
            mbs,
            options=options,
            temperature=r.temperature,
        )  # ends with grad_norm.item(): a host-device sync
        t2 = time.perf_counter()
        rec = StepRecord(t2 - t0, t1 - t0, t2 - t1, float(raw.mean()), work)
        self.records.append(rec)
        return rec

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# The step's GEMM floor
# ----------------------------------------------------------------------------------------------

FLOOR_ROWS = 1024  # rows of the timed prefill / training GEMMs (the fused op's chunks are of this order)


def _gemm_seconds(shapes: list[tuple[int, int]], rows: int, backward: bool, device: torch.device) -> float:
    """Median wall time (of 3, after one untimed pass) of ``[rows, in] @ [in, out]`` for each
    ``(out, in)`` weight shape, with ``backward`` the two GEMMs of its gradients too
    (``[rows, out] @ [out, in]`` and ``[out, rows] @ [rows, in]``)."""
    g = torch.Generator(device).manual_seed(0)
    mats = [
        (torch.randn(rows, i, generator=g, device=device), torch.randn(o, i, generator=g, device=device),
         torch.randn(rows, o, generator=g, device=device))
        for o, i in shapes
    ]  # fmt: skip

    def one_pass() -> None:
        for x, w, dy in mats:
            torch.mm(x, w.t())
            if backward:
                torch.mm(dy, w)
                torch.mm(dy.t(), x)
        if device.type == "cuda":
            torch.cuda.synchronize()

    one_pass()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    return median(times)


def gemm_rates(model: torch.nn.Module, gen_batch: int, device: torch.device) -> dict[str, float]:
    """Seconds per token of each kind of ``StepWork``, from the GEMMs of ``model``'s weights
    alone at the step's shapes on this machine (the torch threads it runs with): ``decode`` (every
    linear layer and the lm_head at ``gen_batch`` rows), ``prefill`` (the layers, forward),
    ``train`` (the layers, forward and backward) and ``head`` (the lm_head, forward and backward).
    Attention's score and value products, norms, activations, sampling and the optimizer are
    left out: a floor no implementation of the same work goes under, not an estimate of one."""
    head = model.get_output_embeddings()
    layers = [
        tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
    ]
    vocab = [tuple(head.weight.shape)]
    with torch.no_grad():
        return {
            "decode": (_gemm_seconds(layers, gen_batch, False, device) + _gemm_seconds(vocab, gen_batch, False, device))
            / gen_batch,
            "prefill": _gemm_seconds(layers, FLOOR_ROWS, False, device) / FLOOR_ROWS,
            "train": _gemm_seconds(layers, FLOOR_ROWS, True, device) / FLOOR_ROWS,
            "head": _gemm_seconds(vocab, FLOOR_ROWS, True, device) / FLOOR_ROWS,
        }  # fmt: skip


def gemm_floor_s(work: StepWork, rates: dict[str, float]) -> float:
    """The step's GEMM floor: its ``work`` at the ``gemm_rates`` (seconds)."""
    return (
        work.gen_tokens * rates["decode"]
        + work.prefill_tokens * rates["prefill"]
        + work.train_tokens * rates["train"]
        + work.head_tokens * rates["head"]
    )


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------


def greedy_accuracy(model: torch.nn.Module, problem: Problem) -> float | None:
    """Greedy exact-match accuracy on the case's held-out problems (tiny only), with the same
    ``HFBackend`` for both tools' models."""
    if not problem.eval_prompts:
        return None
    tok = problem.tokenizer
    backend = HFBackend(model, tok, generation_batch_size=len(problem.eval_prompts))
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in problem.eval_prompts]
    params = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=problem.case.max_tokens, min_tokens=0)
    with torch.random.fork_rng(devices=[]):
        out = backend.generate(ids, params)
    hits = [problem.reward_fn(t, a)["reward"] for t, a in zip(out.response_text, problem.eval_answers)]
    return sum(hits) / len(hits)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def summarize(records: list[StepRecord], warmup: int) -> dict:
    """Medians of the timed steps (after ``warmup``) and every step's figures."""
    timed = records[warmup:]
    return {
        "step_s": median([r.step_s for r in timed]),
        "rollout_s": median([r.rollout_s for r in timed]),
        "train_s": median([r.train_s for r in timed]),
        "step_s_all": [round(r.step_s, 5) for r in records],
        "rollout_s_all": [round(r.rollout_s, 5) for r in records],
        "reward_all": [round(r.reward, 5) for r in records],
        "timed_steps": len(timed),
    }


# ----------------------------------------------------------------------------------------------
# The loss op: grpo_fast, Liger-Kernel, torch.nn.functional.linear_cross_entropy
# ----------------------------------------------------------------------------------------------


def loss_inputs(n: int, d: int, v: int, dtype: torch.dtype, device: str, seqs: int = 16):
    """One problem for every implementation: ``seqs`` sequences of ``n // seqs`` tokens."""
    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(n, d, generator=g, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, device=device) / math.sqrt(d)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    advantages = torch.randn(seqs, generator=g, device=device)
    old = torch.randn(n, generator=g, device=device) - math.log(v)
    return hidden, weight, labels, advantages, old


def _finish(hidden, weight) -> None:
    hidden.grad = None
    weight.grad = None
    if hidden.is_cuda:
        torch.cuda.synchronize()  # sync point: the timer stops after the kernels


def build_loss_step(impl: str, n: int, d: int, v: int, dtype_name: str = "float32", device: str = "cpu"):
    """Forward + backward of the GRPO loss from hidden states (β = 0, sequence-mean, with π_old),
    or, for ``torch_linear_cross_entropy``, the cross-entropy (NLL) of the same tokens: a lower
    bound on the lm_head + log-softmax work, without the GRPO terms or entropy."""
    dtype = getattr(torch, dtype_name)
    seqs = 16
    t = n // seqs
    hidden, weight, labels, advantages, old = loss_inputs(n, d, v, dtype, device, seqs)
    if impl == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")
        mask = torch.ones(seqs, t, device=device, dtype=torch.int64)
        h3, l2, o2 = hidden.view(seqs, t, d), labels.view(seqs, t), old.view(seqs, t)

        def step() -> None:
            loss, _ = loss_fn(h3, weight, l2, mask, advantages, old_per_token_logps=o2)
            loss.backward()
            _finish(hidden, weight)

    elif impl == "torch_linear_cross_entropy":
        import torch.nn.functional as F

        # options: opt in to torch's chunked path (options=None is the reference, which
        # materializes the [N, V] logits); "auto" picks its chunking per (device, dtype)
        options = torch.nn.LinearCrossEntropyOptions()

        def step() -> None:
            F.linear_cross_entropy(hidden, weight, labels, options=options).backward()
            _finish(hidden, weight)

    else:
        from grpo_fast.ops import fused_linear_grpo_loss

        backend, chunk_size = "auto", None
        if impl.startswith("grpo_fast_chunk"):  # grpo_fast_chunk256: 256 rows per chunk
            chunk_size = int(impl.removeprefix("grpo_fast_chunk"))
        elif impl != "grpo_fast":
            backend = impl
        adv_tok = advantages.repeat_interleave(t)
        weights = torch.full((n,), 1.0 / n, device=device)  # sequence-mean: 1 / (seqs · t) per token

        def step() -> None:
            out = fused_linear_grpo_loss(
                hidden,
                weight,
                labels,
                adv_tok,
                weights,
                old_logprobs=old,
                backend=backend,
                chunk_size=chunk_size,
            )
            out.loss.backward()
            _finish(hidden, weight)

    return step


LOSS_ENTROPY = {
    "grpo_fast": True,
    "grpo_fast_chunk256": True,
    "eager": True,
    "liger": False,
    "torch_linear_cross_entropy": False,
}
LOSS_WHAT = {
    "grpo_fast": "GRPO loss + log-probs + entropy (torch_chunked on CPU, triton on CUDA; default chunks)",
    "grpo_fast_chunk256": "the same, chunk_size=256 (Liger's chunk here: one sequence of 256 tokens)",
    "eager": "GRPO loss + entropy from the materialized [N, V] logits (grpo_fast.algo.core reference)",
    "liger": "GRPO loss + log-probs (LigerFusedLinearGRPOLoss, loss_type=grpo)",
    "torch_linear_cross_entropy": "cross-entropy only (F.linear_cross_entropy, chunked options): not a GRPO loss",
}
