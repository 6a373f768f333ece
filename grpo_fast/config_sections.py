"""The config's sections: one frozen dataclass per ``section.*`` of ``grpo_fast.config.Config``
(``model``, ``data``, ``rollout``, ``train``, ``loss``, ``critic``, ``distill``, ``eval``, ``sft``,
``logging``, ``health``, ``threads``, and ``model.lora``), each field declared once as
``option(default, domain)`` (``grpo_fast.domains``), with the bounds the integer keys share.

``grpo_fast.config`` assembles them into ``Config`` and re-exports every class here, so
``from grpo_fast.config import RolloutConfig`` is the public spelling; this module is where
their defaults and domains are written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_fast.algo.advantages import ADVANTAGE_ESTIMATORS, SCALE_REWARDS
from grpo_fast.algo.difficulty import CURRICULA
from grpo_fast.algo.length_norm import LENGTH_NORMS
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.sampler_correction import IS_LEVELS, IS_MODES
from grpo_fast.domains import AUTO, AutoOrBool, OneOf, Range, option
from grpo_fast.ops._backend import BACKENDS as KERNEL_BACKENDS
from grpo_fast.rollout.registry import backends as rollout_backends
from grpo_fast.sandbox.sandbox import ISOLATIONS
from grpo_fast.task.registry import tasks
from grpo_fast.threads import WAIT_POLICIES

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_ANY = Range()  # any finite number
_NONNEG = Range(0)
_POSITIVE = Range(0, lo_open=True)

# Every integer key has an upper bound a run can reach, generous but finite: an absurd value
# (steps=10^23, rollout.batch_size=10^20) is refused in one line naming the key and the bound,
# instead of a plan of 10^19 hours or an allocation that never returns. Each says why it is where
# it is; tests/test_config.py checks that no integer key is unbounded.
MAX_STEPS = 10**8
MAX_SEQUENCES = 2**20
MAX_TOKENS = 2**20
_STEPS_WHY = (
    ": 10^8 steps is 58 days at the tiny preset's fastest, 0.05 s a step (published GRPO runs take thousands)"
)
_SEQUENCES_WHY = (
    ": 2^20 = 1,048,576 sequences, 128 times the largest published GRPO batch (8,192 responses a step)"
)
# the tool caps refuse 0 (TRL read an explicit 0 as "unlimited": sequences grew until out of memory)
_NO_ZERO_CAP = ": this cap is a number of at least 1 (0 does not mean unlimited)"
_TOKENS_WHY = ": 2^20 = 1,048,576 tokens, 8 times the longest context of the models trained here (131,072)"


def _steps(lo: int, **kw: Any) -> Range:
    """A count of steps (or a period in steps): ``[lo, MAX_STEPS]``."""
    return Range(lo, MAX_STEPS, integer=True, hi_why=_STEPS_WHY, **kw)


def _sequences(lo: int, **kw: Any) -> Range:
    """A count of sequences (responses, prompts, problems): ``[lo, MAX_SEQUENCES]``."""
    return Range(lo, MAX_SEQUENCES, integer=True, hi_why=_SEQUENCES_WHY, **kw)


def _tokens(lo: int, **kw: Any) -> Range:
    """A count of tokens (or of rows of logits): ``[lo, MAX_TOKENS]``."""
    return Range(lo, MAX_TOKENS, integer=True, hi_why=_TOKENS_WHY, **kw)


@dataclass(frozen=True)
class LoRAConfig:
    """``model.lora``: a LoRA adapter (peft) on a frozen base; the embeddings and the lm_head stay
    frozen. Off while ``r`` is 0."""

    # the adapter's rank; 0 = off (full fine-tuning)
    r: int = option(
        0,
        Range(
            0,
            2**16,
            integer=True,
            hi_why=": a rank is at most a layer's width, and 2^16 = 65,536 is wider than any model's",
        ),
    )
    alpha: float = option(16.0, Range(0, lo_open=True))  # the update is scaled by alpha / r
    dropout: float = option(0.0, Range(0, 1, hi_open=True))
    # "all-linear" (every linear layer of the decoder: attention and MLP projections) or a list
    # of module names (e.g. [q_proj, v_proj]); each must match a linear layer of the model
    target_modules: Any = "all-linear"
    # The adapter's learning rate is train.lr × lr_scale (the warm start's: sft.lr × lr_scale):
    # LoRA's best learning rate is about 10× full fine-tuning's, nearly whatever the rank
    # (Schulman et al. 2025, "LoRA Without Regret"), so a preset's lr carries over.
    lr_scale: float = option(10.0, _POSITIVE)


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = "Qwen/Qwen2.5-Math-1.5B"
    # The dtype the trained weights are kept in; auto = float32 (master weights, with bf16
    # autocast on CUDA when train.mixed_precision=bf16).
    dtype: str = option(AUTO, OneOf(_DTYPES))
    # flash_attention_2 | sdpa | eager | auto (flash-attn 2 when installed on CUDA, else sdpa)
    attn_implementation: str = option(
        AUTO, OneOf(("auto", "flash_attention_2", "sdpa", "eager")), resume="safe"
    )
    gradient_checkpointing: bool = option(False, resume="safe")
    trust_remote_code: bool = option(False, resume="safe")
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # QLoRA: the frozen base in 4-bit NF4 (bitsandbytes; on CUDA, and on CPU with bnb ≥ 0.50),
    # computing in the run's precision (bf16 under autocast, else fp32); needs model.lora.r > 0
    load_in_4bit: bool = False


@dataclass(frozen=True)
class DataConfig:
    task: str = option("math", OneOf(tuple(tasks())))  # a task module of grpo_fast.task (its registry)
    train_path: str | None = None  # local JSONL/Parquet; None = the task's hub dataset
    eval_path: str | None = None
    hub_name: str | None = None  # override the task's default hub dataset name
    question_field: str | None = None  # None = the task's default field names
    answer_field: str | None = None
    prompt_template: str = "r1_zero"  # r1_zero | question_only | a string holding {question}
    # A name in grpo_fast.task.rewards.REWARD_FNS, package.module:function, or auto (the task's own);
    # or a list of them: the reward is then Σ_k w_k·reward_k (grpo_fast.task.rewards.WeightedReward),
    # each part logged as train/reward/NAME.
    reward: str | list[str] = AUTO
    # One weight per data.reward entry (a list); None = every weight 1.
    reward_weights: list[float] | None = None
    # How a list of rewards makes the advantage: sum (normalize Σ_k w_k·reward_k within its group)
    # | normalize_each (GDPO: normalize each reward within its group, loss.scale_rewards as for the
    # sum, then Σ_k w_k·normalized_k; the shaping terms, overlong and KL, as one more reward of
    # weight 1). The same as sum with one reward and no shaping (grpo_fast.algo.core.normalize_each_reward).
    reward_aggregation: str = option("sum", OneOf(("sum", "normalize_each")))
    eval_subset_size: int = option(1024, _sequences(0))  # evaluated every eval_every steps (fixed seed)
    # A reward function that raises or returns a non-number: raise (stop the run, one line naming
    # the function, the exception and the response) | zero (score it 0, count train/reward_errors)
    reward_errors: str = option("raise", OneOf(("raise", "zero")))
    # Threads scoring one batch's responses (grpo_fast.task.rewards.score_batch; the math grader's
    # symbolic step runs in as many worker processes). auto: the rewards built into grpo_fast on up
    # to 4 (at most the CPUs) when a call is slow (the batch's first takes > 2 ms: a grader, a
    # sandbox), else one by one; a function of your own one by one (it may keep state). A number:
    # that many for every reward function (yours must then be thread-safe).
    reward_workers: Any = option(
        AUTO, Range(1, 64, integer=True, auto_ok=True, hi_why=": threads waiting on graders"), resume="safe"
    )
    # DAPO's soft overlong punishment (grpo_fast.algo.core.overlong_penalty): over the last
    # overlong_buffer tokens before rollout.max_tokens the reward falls linearly from 0 to
    # −overlong_penalty (reached at max_tokens); added to the reward before the advantage. 0 = off.
    overlong_buffer: int = option(0, _tokens(0))
    overlong_penalty: float = option(1.0, _NONNEG)
    # With rollout.environment: subtracted from a response's reward for each of its tool calls that
    # failed (the code raised or hit a limit, the expression did not evaluate), before the
    # advantage, as overlong's; 0 = off.
    tool_error_penalty: float = option(0.0, _NONNEG)
    # The field holding a worked ground-truth solution (sft.mix_coef's target); None = the task's
    # default (math: solution; gsm8k: answer, the text before ####; tiny: the answer itself).
    solution_field: str | None = None
    # A field holding each problem's difficulty (MATH: level, "Level 3" → 3; lower = easier), which
    # rollout.curriculum=easy_first then uses instead of the pass rates; None = no such field.
    difficulty_field: str | None = None


@dataclass(frozen=True)
class RolloutConfig:
    # A backend of grpo_fast.rollout: hf (transformers generate) | vllm (a vLLM engine: rollout.placement)
    backend: str = option("hf", OneOf(tuple(rollout_backends())))
    # responses per prompt; 1 only with an estimator that needs no group (loss.advantage=reinforce_pp:
    # config_checks says why the others refuse it)
    group_size: int = option(8, _sequences(1))
    batch_size: int = option(256, _sequences(1))  # responses per step (a multiple of group_size)
    temperature: float = option(1.0, _POSITIVE)
    top_p: float = option(1.0, Range(0, 1, lo_open=True))
    # top-k sampling: only the top_k most likely tokens (after the temperature, before top_p, as
    # vLLM and transformers apply them); 0 = off. The trainer's log-probs follow (loss.truncated_logprobs).
    top_k: int = option(
        0, Range(0, 2**20, integer=True, hi_why=": 2^20 is above any vocabulary (Qwen2.5's: 151,936)")
    )
    max_tokens: int = option(1024, _tokens(1))  # response tokens
    min_tokens: int = option(4, _tokens(0))
    max_prompt_tokens: int = option(512, _tokens(1))  # longer prompts are left-truncated, with a warning
    # hf backend: prompts·group_size sequences per generate call
    generation_batch_size: int = option(64, _sequences(1), resume="safe")
    # vllm: fraction of the card, or auto (memory planner)
    gpu_memory_utilization: Any = option(AUTO, Range(0.05, 0.99, auto_ok=True), resume="safe")
    # vllm sleep mode during the training phase: 0 = stay awake, 1 = offload the weights to CPU
    # RAM, 2 = discard them (the next push refills them). Where the platform has no sleep mode
    # (CPU), the engine stays awake whatever the level, and says so once in the log.
    sleep_level: int = option(1, OneOf((0, 1, 2)), resume="safe")
    # After each weight push, vLLM's log-probs of a fixed probe sequence are compared with the
    # trainer's; a mean |Δ log p| above this stops the run. auto: 1e-3 when vLLM serves fp32,
    # 0.05 in bf16/fp16 (grpo_fast.rollout.vllm.WEIGHT_SYNC_TOLERANCE).
    weight_sync_tolerance: Any = option(AUTO, Range(0, auto_ok=True), resume="safe")
    # Truncated importance sampling against the sampler's log-probs (vllm): each token's loss is
    # weighted by ρ = exp(logp_trainer_old − logp_sampler), per token (is_level=token) or the
    # product over the response (sequence); ρ > is_cap is cut to is_cap (is_mode=truncate) or
    # its tokens get weight 0 (mask).
    is_correction: bool = False
    is_level: str = option("token", OneOf(IS_LEVELS))
    is_mode: str = option("truncate", OneOf(IS_MODES))
    is_cap: float = option(2.0, Range(1, lo_open=True))
    # π_old when train.epochs_per_rollout_batch > 1: trainer (a no-grad pass of the fused op over
    # the rollout batch) | sampler (the engine's log-probs: one forward pass saved per batch).
    old_logprobs: str = option("trainer", OneOf(("trainer", "sampler")))
    # DAPO dynamic sampling: groups whose rewards are all equal are dropped and more prompts are
    # generated until the step has batch_size responses from informative groups, for at most
    # max_sampling_rounds generation rounds (then it trains on what it has, and says so).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = option(
        3,
        Range(
            1,
            10**4,
            integer=True,
            hi_why=": each round generates a whole batch (10^4 rounds: 10^4 steps' worth)",
        ),
    )
    # [lo, hi]: after a prompt's first visit, skip it while its pass rate (grpo_fast.algo.difficulty)
    # is outside [lo, hi], e.g. [0.0, 0.9] drops the prompts already solved; None = off.
    difficulty_filter: list[float] | None = None
    # none | easy_first: each pass over the data goes from the easiest prompt to the hardest
    # (data.difficulty_field when set, else the pass rates; grpo_fast.algo.prompt_sampler) | paced:
    curriculum: str = option("none", OneOf(CURRICULA))
    # paced: each step draws at random from the easiest curriculum_start of the prompts (same
    # easiness), a share growing linearly to all of them over curriculum_steps steps (null: half
    # the run's steps), never a sort (grpo_fast.algo.difficulty.paced_quantile)
    curriculum_start: float = option(0.25, Range(0, 1, lo_open=True))
    curriculum_steps: int | None = option(None, _steps(1, none_ok=True))
    # Group size per prompt by its pass rate, between min_group_size (solved) and max_group_size
    # (never solved); unseen prompts get group_size; each step still has batch_size responses.
    adaptive_group_size: bool = False
    min_group_size: int = option(2, _sequences(2))
    max_group_size: int = option(16, _sequences(2))  # at least min_group_size
    # With model.lora, what a backend with its own weights (vllm) gets after each step: adapter (the
    # adapter alone, served as a LoRA request) | merged (the adapter merged into a copy of the
    # base's affected weights, pushed as full weights: faster decoding, not with a 4-bit base)
    lora_sync: str = option("adapter", OneOf(("adapter", "merged")), resume="safe")
    # More keyword arguments for vllm.LLM, e.g. {enforce_eager: true, max_num_seqs: 128}; those
    # grpo_fast sets itself (grpo_fast.rollout.vllm.VLLM_MANAGED_ARGS) are refused. With
    # placement=process: AsyncEngineArgs; server: command-line flags (--enforce-eager --max-num-seqs 128).
    vllm_kwargs: dict[str, Any] = option(factory=dict, resume="safe")
    # Multi-turn rollouts with a tool (docs/tools.md, grpo_fast.rollout.multi_turn): none | a
    # built-in environment of grpo_fast.env (python: code in the sandbox; calculator) | the import
    # path of a module of yours that declares ENVIRONMENT. A turn ends on the environment's stop
    # string, its call runs, the output comes back as inserted tokens (context, never a label).
    environment: str = "none"
    # The caps per response; a response that hits one ends with a finish reason naming it. Calls
    # run per response (then "max_tool_calls"); 0 means zero calls (never "unlimited": the first
    # request ends the response unrun). The other caps are at least 1.
    max_tool_calls: int = option(
        4,
        Range(0, 1024, integer=True, hi_why=": a call a turn, and 1,024 turns is past any context"),
    )
    # Sampled turns per response (then "max_turns"); auto: max_tool_calls + 1
    max_turns: Any = option(
        AUTO,
        Range(
            1, 1025, integer=True, auto_ok=True, why=_NO_ZERO_CAP, hi_why=": max_tool_calls + 1 at most 1,025"
        ),
    )
    # Tokens inserted after one call, the environment's wrapping included; a longer output is cut
    # in the middle with a visible "[... N characters of output cut ...]"
    max_tool_output_tokens: int = option(256, _tokens(1, why=_NO_ZERO_CAP))
    # Sampled + inserted tokens of a response (then "max_response_tokens"); rollout.max_tokens stays
    # the budget of sampled tokens alone (then "length"). auto: max_tokens + max_tool_calls ×
    # max_tool_output_tokens, the most a response can hold. The context is max_prompt_tokens + this.
    max_response_tokens: Any = option(AUTO, _tokens(1, auto_ok=True, why=_NO_ZERO_CAP))
    # Seconds per call (the python sandbox's wall clock; the calculator is bounded by construction)
    tool_timeout_s: float = option(
        10.0, Range(0, 3600, lo_open=True, hi_why=": a call holds its whole batch of rows back")
    )
    # The python sandbox: bwrap (bubblewrap namespaces: no network, no host files; docs/tools.md) |
    # unsafe (trusted code only: the same limits, no isolation)
    tool_isolation: str = option("bwrap", OneOf(ISOLATIONS))
    # Calls run at once (the sandbox pool's width); auto: this process's CPUs, at most 8
    tool_workers: Any = option(
        AUTO,
        Range(1, 256, integer=True, auto_ok=True, hi_why=": each running call is a process"),
        resume="safe",
    )
    # Where the vllm engine runs: colocated (in the training process; sleep mode between phases)
    # | process (vLLM's AsyncLLM: its engine core in a child process on this machine) | server (a
    # vLLM OpenAI-compatible server the run starts on 127.0.0.1, or rollout.server_url). process
    # and server take the weights through vLLM's weight-transfer API and may generate while a
    # sync lands (docs/rollout.md: where the engine runs).
    # Generation apart from training (grpo_fast.loop.pipeline): 0 = lockstep (generate, score,
    # train, sync, repeat); S > 0: a producer generates and scores step k + S while the trainer
    # trains step k, each batch sampled by the policy S optimizer steps behind (never more: an
    # older batch is refused and regenerated). Needs an off-policy correction against the
    # sampler's log-probs: rollout.is_correction=true or rollout.old_logprobs=sampler. With vllm,
    # the engine apart (placement=process|server) takes each version as the trainer staged it.
    max_staleness: int = option(
        0,
        Range(
            0,
            8,
            integer=True,
            hi_why=": each step of staleness keeps one more copy of the trainable weights in the "
            "pipeline and in every checkpoint; one step already overlaps generation with training",
        ),
    )
    # Where generation runs: colocated (in the training process: vllm with sleep mode between
    # phases; hf with max_staleness > 0 from a copy of the weights in a thread) | process (vllm:
    # vLLM's AsyncLLM, its engine core in a child process on this machine; hf: the decoder in a
    # worker process with its own copy of the weights and its own CPU threads, synced exactly after
    # every step) | server (vllm only: a vLLM OpenAI-compatible server the run starts on 127.0.0.1,
    # or rollout.server_url; under torchrun one for every rank, rank 0 pushing). vllm process and
    # server take the weights through vLLM's weight-transfer API and may generate while a sync
    # lands (docs/rollout.md: where the engine runs). vllm process: one trainer process only.
    placement: str = option("colocated", OneOf(("colocated", "process", "server")), resume="safe")
    # placement=process (hf): torch threads of the worker process; auto = half the CPUs this
    # process may use (the trainer keeps the rest): 1 each on 2 cores
    worker_threads: Any = option(
        AUTO,
        Range(1, 1024, integer=True, auto_ok=True, hi_why=": more threads than any machine's cores"),
        resume="safe",
    )
    # The engines generating for this trainer process (a fleet, grpo_fast.rollout.fleet): hf worker
    # processes (backend=hf, placement=process), vLLM engine processes (vllm, process) or vLLM
    # servers the run starts (vllm, server; servers it attaches to: a list in rollout.server_url).
    # Each prompt batch is cut into shards balanced over them, each with its own seed; one that
    # dies, times out or fails its weight probe is taken out of service, its shard re-sent with the
    # same seed, and it is restarted (a listed server: attached again), loaded and probed in the
    # background. 1: one engine, as before (docs/rollout.md: a fleet of engines)
    num_engines: int = option(
        1, Range(1, 64, integer=True, hi_why=": each engine holds a whole copy of the policy"), resume="safe"
    )
    # the engines in service the run goes on with; below it the run stops with one line and the
    # last step's checkpoint (1..num_engines)
    min_engines: int = option(
        1,
        Range(1, 64, integer=True, hi_why=": it cannot exceed rollout.num_engines (64 at most)"),
        resume="safe",
    )
    # placement=server: the base URL of a running vLLM server to attach to (http://127.0.0.1:8000),
    # started as docs/rollout.md says, or a list of them (a fleet of those servers:
    # [http://h1:8000,http://h2:8000]); null: the run starts its own, rollout.num_engines of them
    # (logs: output_dir/vllm_server.log, a fleet's vllm_server.<i>.log)
    server_url: str | list[str] | None = option(None, resume="safe")
    # placement=process|server (vllm): how the weights travel: shm (safetensors files in /dev/shm,
    # loaded by the engine's workers: any platform, the engine on this machine) | nccl (vLLM's NCCL
    # broadcast from the trainer's GPU to the engine's GPUs: rollout.engine_devices)
    weight_transfer: str = option("shm", OneOf(("shm", "nccl")), resume="safe")
    # placement=process|server (vllm, a server the run starts): the GPUs the engine runs on, as the
    # trainer numbers them (several: tensor parallel); a fleet (rollout.num_engines > 1): one list
    # per engine ([[1], [2]]); null: the trainer's own device
    engine_devices: list[Any] | None = option(None, resume="safe")  # ints, or lists of ints
    # Seconds the run waits, with an engine apart (placement=process|server) or the pipeline, for:
    # the engine to start (its process or server answering) | one rollout batch (its generation,
    # and in the pipeline its scoring) | one weight sync. A wait past its limit, or an engine that
    # died, stops the run with one line (grpo_fast.errors.EngineError) and a resumable checkpoint.
    start_timeout: float = option(900.0, _POSITIVE, resume="safe")
    request_timeout: float = option(3600.0, _POSITIVE, resume="safe")
    sync_timeout: float = option(600.0, _POSITIVE, resume="safe")

    @property
    def prompts_per_step(self) -> int:
        """The prompts a step samples over every rank: ``batch_size / group_size`` (a whole number:
        config_checks), each rank generating ``prompts_per_step / ranks`` of them."""
        return self.batch_size // self.group_size


@dataclass(frozen=True)
class TrainConfig:
    lr: float = option(1e-6, _NONNEG)
    # adamw | adamw8bit (bitsandbytes; also on CPU with bnb ≥ 0.50)
    optimizer: str = option("adamw", OneOf(("adamw", "adamw8bit")))
    # optimizer=adamw as torch's fused kernel (one kernel over every tensor: 4-7x faster a step on a
    # CPU, measured; the same update, rounded per element otherwise). auto: on CUDA; on a CPU the
    # per-tensor form, whose rounding the published CPU runs and the tests' learning bars were
    # measured with (docs/training.md: the optimizer step)
    fused_optimizer: bool | str = option(AUTO, AutoOrBool())
    betas: tuple[float, float] = (0.9, 0.999)  # two numbers in [0, 1)
    weight_decay: float = option(0.0, _NONNEG)
    warmup_steps: int = option(0, _steps(0))
    # constant | linear | cosine (after warmup, to min_lr_ratio·lr)
    schedule: str = option("constant", OneOf(("constant", "linear", "cosine")))
    min_lr_ratio: float = option(0.0, Range(0, 1))
    grad_clip: float = option(1.0, _NONNEG)
    # sequences per microbatch, or auto (memory planner)
    micro_batch_size: Any = option(AUTO, _sequences(1, auto_ok=True), resume="safe")
    # > 1 computes old log-probs and clips off-policy
    epochs_per_rollout_batch: int = option(
        1,
        Range(
            1,
            1000,
            integer=True,
            hi_why=": each epoch is one more pass over the rollout batch (PPO and GRPO take 1-4)",
        ),
    )
    # padding-free packing of microbatches (flash-attn varlen / sdpa mask)
    packing: bool = option(False, resume="safe")
    # Each prompt computed once for all its responses in the training forward and backward (and the
    # π_old / π_ref passes): [prompt, r_1 … r_G] rows, the same gradients to fp32 summation order
    # (grpo_fast.policy.batch.shared_prompt_microbatches, policy/shared_attention.py); needs sdpa or
    # eager attention. auto: on, unless model.attn_implementation=flash_attention_2 (shares_prompts)
    share_prompts: bool | str = option(AUTO, AutoOrBool(), resume="safe")
    # Skip the forward/backward of responses whose advantage is exactly 0 (groups whose rewards are
    # all equal) where the loss says their gradient is exactly 0 (LossOptions.zero_advantage_zero_gradient).
    skip_zero_advantage: bool = True
    # auto: bf16 autocast over fp32 master weights on CUDA and on a CPU with native bf16 dot
    # products (AVX512-BF16, AMX: grpo_fast.policy.model.cpu_computes_bf16), else no (fp32)
    mixed_precision: str = option(AUTO, OneOf(("auto", "bf16", "fp16", "no")))
    # dtype of the final model in output_dir/final: auto (the trained weights' dtype) | float32
    # | bfloat16 | float16 (e.g. bfloat16 for serving: half the size of fp32 master weights)
    save_dtype: str = option(AUTO, OneOf(_DTYPES), resume="safe")
    # With model.lora: also write output_dir/final_merged, the adapter merged into the base
    # (Hugging Face format, train.save_dtype), for serving without peft
    save_merged: bool = option(False, resume="safe")
    # A step whose loss or gradient norm is NaN/inf is not applied (optimizer step skipped, logged);
    # this many in a row stop the run (the checkpoint before them is intact).
    max_nonfinite_steps: int = option(3, _steps(1), resume="safe")
    # Under torchrun: ddp (every rank holds the whole model, gradients and AdamW state) | fsdp
    # (FSDP2, ZeRO-3-style: each holds 1/N of them; sharded checkpoints; grpo_fast.policy.fsdp)
    parallelism: str = option("ddp", OneOf(("ddp", "fsdp")))
    # With fsdp: the weight shards, their gradients and the optimizer step in CPU RAM (ZeRO-3 offload)
    fsdp_cpu_offload: bool = option(False, resume="safe")
    # Under torchrun: sequence parallelism (Ulysses). Groups of this many ranks train one batch, each
    # holding 1/N of every sequence's tokens through the decoder (per-rank activations ≈ 1/N: long
    # responses), attention by all-to-all (grpo_fast/policy/sequence_parallel.py). Generation stays
    # whole-sequence: each rank generates its share, then the group shares its batch. It must divide
    # the ranks and the model's attention and key/value heads; sdpa or eager attention. "safe": the
    # same batches and gradient (to fp32 summation order), less memory per rank.
    sequence_parallel: int = option(
        1,
        Range(1, 1024, integer=True, hi_why=": it divides the model's attention heads (Qwen2.5: 12 to 40)"),
        resume="safe",
    )


@dataclass(frozen=True)
class LossConfig(LossOptions):
    """``loss.*``: the loss options (``LossOptions``: type, clip_low, clip_high, dual_clip, delta,
    importance_sampling_level, top_entropy_quantile, beta, kl_estimator, entropy_coef; their
    defaults and domains live there), and the loop's loss settings below."""

    # Two options a training run takes in a narrower domain than the math (LossOptions, which the
    # public functions accept); the default stays LossOptions'.
    clip_low: float = option(
        LossOptions.clip_low,
        Range(
            0,
            1,
            hi_open=True,
            why=": a run keeps the lower side of the trust region, 1 − clip_low > 0 (clip_low ≥ 1 "
            "would switch it off; the course API's cliprange may)",
        ),
    )
    beta: float = option(
        LossOptions.beta,
        Range(0, why=": the weight of the KL penalty to π_ref (a negative one would reward drifting away)"),
    )
    length_norm: str = option(
        "sequence_mean", OneOf(LENGTH_NORMS)
    )  # | constant (Dr. GRPO) | token_mean (DAPO)
    # true: responses that hit rollout.max_tokens get no loss at all and are not counted in the
    # length normalizers (DAPO's overlong filtering); their rewards still enter the group's advantage.
    mask_truncated: bool = False
    # true: the same for responses with a void turn (rollout.environment): a turn that yielded
    # neither a tool call nor an answer (EOS after nothing but whitespace, or the environment's
    # stop string with no request), SimpleTIR's void-turn filtering.
    mask_void_turns: bool = False
    # true: β·KL enters the reward, not the loss (verl's use_kl_in_reward): each response's reward
    # loses β·Σ_t k1_t, k1 = log π − log π_ref on its sampled tokens, before the advantages (two
    # no-grad passes in the rollout phase, π and π_ref); the loss then has no KL term.
    kl_in_reward: bool = False
    # adaptive β (proportional controller) when set; per-token KL
    target_kl: float | None = option(None, Range(0, lo_open=True, none_ok=True))
    # stop the inner epochs once KL(π_old‖π) exceeds this
    kl_early_stop: float | None = option(None, Range(0, lo_open=True, none_ok=True))
    # Adaptive entropy coefficient when set (Skywork-OR1; TRL's use_adaptive_entropy): after each
    # step, loss.entropy_coef (the start value) rises by entropy_coef_step, up to entropy_coef_max,
    # while the step's mean token entropy is at or below entropy_target, and falls by it (down to
    # 0) above; the loss applies it only while the last step's entropy was at or below the target.
    entropy_target: float | None = option(None, Range(0, lo_open=True, none_ok=True))
    entropy_coef_max: float = option(1.0, _NONNEG)
    entropy_coef_step: float = option(0.005, _POSITIVE)
    # How rewards become advantages (docs/loss.md, "Advantage estimators"): group (GRPO: against the
    # group's mean) | rloo (against the mean of the others) | reinforce_pp (REINFORCE++: per-token
    # returns whitened over the batch) | reinforce_pp_baseline (the group's mean off first) | gae
    # (per token, from a value model: critic.*)
    advantage: str = option("group", OneOf(ADVANTAGE_ESTIMATORS))
    # the discount per sampled token of the per-token estimators (reinforce_pp*, gae): 1 = the
    # whole outcome reward on every token, as REINFORCE++'s default
    gamma: float = option(1.0, Range(0, 1))
    scale_rewards: str = option("group", OneOf(SCALE_REWARDS))  # the advantage's std: group | batch | none
    advantage_eps: float = option(1e-6, _NONNEG)
    # The trainer's log-probs, entropies and gradients under truncated sampling (rollout.top_k > 0
    # or rollout.top_p < 1): those of the distribution the sampler drew from, log π(a) − log Σ_kept π
    # (true), or of the full vocabulary (false: what TRL and verl compute, off by the kept mass).
    # auto = true whenever the sampler truncates (grpo_fast.policy.loss.trainer_truncation).
    truncated_logprobs: bool | str = option(AUTO, AutoOrBool())
    kernel_backend: str = option(
        AUTO, OneOf(KERNEL_BACKENDS), resume="safe"
    )  # auto | triton | torch_chunked | eager
    # rows of logits per lm_head chunk, or auto (memory budget)
    chunk_size: Any = option(AUTO, _tokens(1, auto_ok=True), resume="safe")

    def __post_init__(self) -> None:
        """Checked by ``validate`` with the ``loss.`` prefix, with the rest of the config."""


# Keys that no longer exist -> what to write instead (a ConfigError says so).
_REPLACED_KEYS = {
    "loss.normalize_by_std": "use loss.scale_rewards=group (was true) or none (was false); batch is new",
    # the evaluation's sampling is its own section: eval.temperature, eval.top_p, eval.max_tokens, eval.k
    "rollout.eval_temperature": "use eval.temperature (the same meaning; 0 = greedy; auto: greedy at eval.k=1)",
}


@dataclass(frozen=True)
class CriticConfig:
    """``critic.*``: the value model of ``loss.advantage=gae`` (docs/loss.md, "The value model"): a
    linear value head on the policy's last hidden states (the ones the fused op already has), trained
    beside the policy with a clipped value loss. Any key set away from its default needs
    ``loss.advantage=gae``."""

    # the head's learning rate; null = train.lr (the schedule's warm-up and decay apply to it too)
    lr: float | None = option(None, Range(0, lo_open=True, none_ok=True))
    # PPO's value clip: the new value stays within ±value_clip of the one the advantages were
    # computed with (the larger of the clipped and unclipped squared errors); null = off
    value_clip: float | None = option(0.2, Range(0, lo_open=True, none_ok=True))
    # how much of the value loss's gradient reaches the policy's shared layers: 0 = none (the head
    # alone learns: no interference with the policy), 1 = all of it (a shared-trunk critic)
    trunk_coef: float = option(0.0, Range(0, 1))
    # the first warmup_steps steps train the value head only (the policy's weights untouched)
    warmup_steps: int = option(0, _steps(0))
    # GAE's λ for the value targets (returns = A(λ) + V; VAPO's decoupled λ: 1.0, Monte Carlo)
    lam: float = option(1.0, Range(0, 1))
    # GAE's λ for the policy's advantages
    policy_lam: float = option(0.95, Range(0, 1))
    # VAPO's length-adaptive policy λ = 1 − 1/(α·l) for a response of l sampled tokens (at least
    # 0), in place of policy_lam; null = off (VAPO: α = 0.05)
    lam_alpha: float | None = option(None, Range(0, lo_open=True, none_ok=True))
    # the policy's GAE advantages whitened over the batch's sampled tokens (mean 0, std 1, across
    # ranks), as PPO implementations do; false = the raw GAE (in the rewards' units)
    whiten_advantages: bool = True


@dataclass(frozen=True)
class DistillConfig:
    """``distill.*``: on-policy distillation (docs/loss.md, "On-policy distillation"): a frozen
    teacher's per-token log-probs of the student's own samples as a dense reward, each sampled
    token's advantage ``reward_weight · A_t + coef · (log π_teacher − log π_student)_t``."""

    # a trained model's folder or hub name sharing the student's tokenizer; null = off
    teacher: str | None = None
    # the weight of the per-token term (the negative of the per-token reverse KL to the teacher)
    coef: float = option(1.0, Range(0, lo_open=True))
    # the weight of loss.advantage's advantage beside it; 0 = pure distillation
    reward_weight: float = option(1.0, Range(0))
    # the teacher's linear layers in NF4 (bitsandbytes; its lm_head stays as loaded): a quarter of
    # its bf16 bytes, for a teacher larger than the student (placement=trainer)
    load_in_4bit: bool = False
    # where the teacher runs: trainer (loaded beside the student, its pass through the fused op) |
    # server (a vLLM server: its prompt log-probs of each response, at temperature 1 over the whole
    # vocabulary; no trainer memory; the requests overlap the student's own pass)
    placement: str = option("trainer", OneOf(("trainer", "server")))
    # placement=server: the base URL of a vLLM server serving distill.teacher (started with
    # --enable-scale-out, docs/loss.md); null: the run starts one (log: output_dir/vllm_teacher.log)
    server_url: str | None = None
    # placement=server, a server the run starts on a GPU machine: its GPUs, as the trainer numbers
    # them (several: tensor parallel); none of the trainer's or the rollout engines'
    devices: list[int] | None = None


@dataclass(frozen=True)
class EvalConfig:
    """``eval.*``: what the evaluations sample and grade (docs/evaluation.md): the sets, ``k``
    samples per problem at the evaluation's own sampling, pass@k and avg@k per set. When they run
    is ``eval_every`` (a fixed subset of ``data.eval_subset_size`` problems of each set) and
    ``full_eval_every`` (every problem). Nothing here changes training: a resume may change any."""

    RESUME = "safe"  # every key of the section (grpo_fast.config.resume_class)

    # The sets by name (grpo_fast.task.eval_sets): data.task's own (its eval split, data.prompt_template,
    # data.reward), a registered set with its own template and reward (tiny_3digit, gsm8k, math500,
    # aime24, amc23, ...), or NAME=PATH (a .jsonl/.parquet file read with data.task's fields, template
    # and reward). Empty = [data.task]. The first set's metrics are also the headline eval/accuracy.
    sets: list[str] = field(default_factory=list)
    # samples per problem: eval/<set>/avg@k (the mean correctness of all k·problems samples) and the
    # unbiased pass@j (Chen et al. 2021) for j = 2, 4, 8, ... and k; above 1 needs a temperature
    k: int = option(
        1, Range(1, 1024, integer=True, hi_why=": 1,024 samples a problem (papers report up to avg@64)")
    )
    # 0 = greedy (then top_p 1, top_k 0); auto: greedy at k = 1, rollout.temperature (the policy's own
    # sampling, what it trains on) above, so that `grpo-fast evaluate --k 16` samples as it should
    temperature: Any = option(AUTO, Range(0, auto_ok=True))
    top_p: float = option(1.0, Range(0, 1, lo_open=True))
    # new tokens a response; auto = rollout.max_tokens
    max_tokens: Any = option(AUTO, Range(1, MAX_TOKENS, integer=True, auto_ok=True, hi_why=_TOKENS_WHY))

    def sampling_temperature(self, rollout_temperature: float) -> float:
        """The temperature the evaluation samples at: ``temperature``, its ``auto`` resolved (0 at
        k = 1, ``rollout_temperature`` above)."""
        if self.temperature != AUTO:
            return self.temperature
        return 0.0 if self.k == 1 else rollout_temperature


@dataclass(frozen=True)
class SFTConfig:
    """An optional supervised warm start before GRPO, logged separately (``sft_metrics.jsonl``)."""

    steps: int = option(0, _steps(0))  # the most SFT steps (0 = no warm start)
    lr: float = option(1e-3, _NONNEG)
    batch_size: int = option(64, _sequences(1))
    # Stop early once greedy accuracy on check_size *training* problems reaches this (checked
    # every check_every steps); None = always run all steps.
    target_accuracy: float | None = option(None, Range(0, 1, lo_open=True, none_ok=True))
    check_every: int = option(10, _steps(1))
    check_size: int = option(200, _sequences(1))
    # > 0: during GRPO, add mix_coef × the per-token-mean NLL of the step's prompts' ground-truth
    # solutions (data.solution_field) to the GRPO loss, logged separately; 0 = pure RL.
    mix_coef: float = option(0.0, _NONNEG)
    # Under model.lora, what the warm start trains: adapter (the adapter GRPO then goes on
    # training) | base (the whole model, frozen afterwards as the adapter's base and written to
    # output_dir/base; π_ref is then the warm-started policy) | auto: base for the built-in model,
    # whose warm start stands in for pretraining (random weights), adapter for any other.
    target: str = option(AUTO, OneOf(("auto", "adapter", "base")))

    def resolved_target(self, model_name: str) -> str:
        """``target`` with ``auto`` resolved for ``model.name_or_path``."""
        if self.target != AUTO:
            return self.target
        return "base" if model_name.startswith("builtin:") else "adapter"


@dataclass(frozen=True)
class LoggingConfig:
    """``logging.*``: what a run writes and shows; a resume may change any of it."""

    RESUME = "safe"  # every key of the section (grpo_fast.config.resume_class)
    wandb: bool = False
    wandb_project: str = "grpo_fast"
    # online | offline | auto (offline without WANDB_API_KEY) | disabled
    wandb_mode: str = option(AUTO, OneOf(("auto", "online", "offline", "disabled")))
    progress: bool = True  # rich progress bars per phase
    sample_every: int = option(10, _steps(0))  # write samples/step_N.jsonl every N steps (0 = never)
    samples_per_dump: int = option(16, _sequences(0))


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = option(True, resume="safe")
    auto_temperature: bool = False  # temporarily raise the temperature on repetition loops
    # Overrides of grpo_fast.obs.health.HealthThresholds fields (their defaults live there), e.g.
    # {entropy_warn_low: 0.1} for a task whose answers are short and nearly deterministic.
    thresholds: dict[str, float] = option(factory=dict, resume="safe")


@dataclass(frozen=True)
class ThreadsConfig:
    """``threads.*``: the CPU threads of the trainer (``grpo_fast.threads``); the plan line says
    what a run uses and why."""

    RESUME = "safe"  # every key of the section (grpo_fast.config.resume_class)
    # torch's intra-op threads. auto: the user's OMP_NUM_THREADS if set (never overwritten), else
    # on a CPU run the cores other work leaves free, re-read at step ends (each change logged,
    # time/cpu_threads per step); 1 for a model of hidden size <= 256 under a passive wait; a
    # GPU run keeps torch's own.
    intra_op: Any = option(
        AUTO,
        Range(1, 1024, integer=True, auto_ok=True, hi_why=": more threads than any one CPU socket has cores"),
    )
    # OpenMP's wait between parallel regions: passive (sleep: no spinning on cores another
    # process needs) | active (spin) | auto: the environment's OMP_WAIT_POLICY / GOMP_SPINCOUNT,
    # else a short spin (GOMP_SPINCOUNT=30000, ~2.6 ms; passive with OMP_NUM_THREADS set: the
    # commands set it before torch loads).
    # passive/active differing from the environment: the training command starts itself again
    # with OMP_WAIT_POLICY set.
    wait_policy: str = option(AUTO, OneOf(WAIT_POLICIES))
