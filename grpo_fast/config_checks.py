"""The config's checks (``grpo_fast.config.validate`` runs them): each key against its domain
(the table: ``option(default, domain)`` beside every default in ``grpo_fast.config``), then the
relations between keys, the rollout backend's own checks, and what this machine and this launch
must have (paths the filesystem can hold; under torchrun, what the ranks it started must split).
Each raises ``ConfigError`` with one line naming the key at fault. The rollout's checks (backends,
placement, the pipeline and the fleet, tools) are ``grpo_fast.config_checks_rollout``'s; ``pipelined``
is re-exported from there.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import math
import os
from typing import TYPE_CHECKING, Any

from grpo_fast.algo.advantages import GROUP_ESTIMATORS, PER_TOKEN_ESTIMATORS
from grpo_fast.config_checks_rollout import check_rollout, pipelined
from grpo_fast.domains import AUTO, DomainError, check_fields
from grpo_fast.env.registry import cannot_run_here
from grpo_fast.errors import ConfigError, shown
from grpo_fast.ops._backend import triton_unavailable
from grpo_fast.rollout.fleet import fleet_size
from grpo_fast.rollout.registry import backend as rollout_backend
from grpo_fast.task.prompts import get_template

if TYPE_CHECKING:  # grpo_fast.config imports this module: the checks take its objects as they come
    from grpo_fast.config import Config, DataConfig

GPU_PRESETS = ("rtx4090", "h100")  # the presets that need a CUDA GPU (grpo_fast.presets.PRESETS)


def validate(cfg: Config, preset: str | None = None, check_device: bool = True) -> None:
    """Each key against its domain (the table: ``option(default, domain)`` beside every default),
    then the relations between keys, then the rollout backend's own checks; each error names
    its key. ``check_device=False`` skips what this machine must have (CUDA for a GPU preset,
    the backend's library), so that a GPU preset can be planned on a CPU.
    """
    for key, value in _numeric_leaves(cfg):  # NaN/inf is meaningless for every numeric key
        if isinstance(value, float) and not math.isfinite(value):  # (an int is finite, however long)
            raise ConfigError(f"{key}={value} is not a finite number")
    try:
        _check_table(cfg)
        cfg.loss.validate("loss.")  # the loss options' relations (dual_clip with its type)
    except DomainError as exc:
        raise ConfigError(str(exc)) from None
    _check_model(cfg)
    check_rollout(cfg)
    _check_reward(cfg.data)
    _check_prompt_template(cfg.data)
    _check_train_and_loss(cfg)
    _check_eval(cfg)
    _check_parallelism(cfg)
    from grpo_fast.obs.health import HealthThresholds

    valid = {f.name for f in dataclasses.fields(HealthThresholds)}
    for key in cfg.health.thresholds:
        if key not in valid:
            near = difflib.get_close_matches(key, sorted(valid), n=1)
            hint = f" (did you mean 'health.thresholds.{near[0]}'?)" if near else ""
            raise ConfigError(f"unknown config key 'health.thresholds.{key}'{hint}")
    HealthThresholds(**cfg.health.thresholds)  # its own consistency checks raise ConfigError
    if check_device:
        _check_machine(cfg, preset)


def _check_table(section: Any, prefix: str = "") -> None:
    """Every field of ``section`` and of its sub-sections against its declared domain."""
    check_fields(section, prefix)
    for f in dataclasses.fields(section):
        if dataclasses.is_dataclass(value := getattr(section, f.name)):  # a nested section
            _check_table(value, f"{prefix}{f.name}.")


def _check_model(cfg: Config) -> None:
    """LoRA and QLoRA: the target modules' form (whether they match the model is checked when it
    loads), 4-bit only with an adapter, and a KL reference that is the policy GRPO starts from."""
    m, lora = cfg.model, cfg.model.lora
    targets = lora.target_modules
    if not (
        targets == "all-linear"
        or (isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets))
    ):
        raise ConfigError(
            f"model.lora.target_modules must be 'all-linear' or a list of module names, got {targets!r}"
        )
    if m.load_in_4bit and lora.r == 0:
        raise ConfigError(
            "model.load_in_4bit=true needs an adapter to train (model.lora.r > 0): a 4-bit base cannot be "
            "fine-tuned itself"
        )
    needs_ref = cfg.loss.beta > 0 or cfg.loss.target_kl is not None or cfg.loss.kl_in_reward
    on_adapter = cfg.sft.resolved_target(m.name_or_path) == "adapter"
    if lora.r and cfg.sft.steps > 0 and on_adapter and needs_ref:
        raise ConfigError(
            "model.lora with a warm start on the adapter (sft.steps > 0, sft.target=adapter) and a KL "
            "reference (loss.beta > 0): π_ref is the base with the adapter off, which would not hold the "
            "warm start; set sft.target=base, sft.steps=0 or loss.beta=0"
        )
    if cfg.train.share_prompts is True and m.attn_implementation == "flash_attention_2":
        raise ConfigError(
            "train.share_prompts=true runs its own attention around sdpa or eager: model.attn_implementation="
            "sdpa, eager or auto (which picks sdpa then), not flash_attention_2; or train.share_prompts=false"
        )
    if cfg.train.sequence_parallel > 1 and m.attn_implementation == "flash_attention_2":
        raise ConfigError(
            f"train.sequence_parallel={cfg.train.sequence_parallel} runs Ulysses attention around sdpa or eager: "
            "model.attn_implementation=sdpa, eager or auto (which picks sdpa then), not flash_attention_2"
        )
    whole = not lora.r or (cfg.sft.steps > 0 and cfg.sft.resolved_target(m.name_or_path) == "base")
    if m.dtype == "float16" and whole:  # AdamW's state in fp16: NaN at the first zero gradient
        what = (
            "the warm start trains the whole model (sft.target=base)" if lora.r else "the whole model trains"
        )
        raise ConfigError(
            f"model.dtype=float16 keeps the weights that train in fp16 ({what}): AdamW then computes "
            "its step in fp16, where its eps=1e-8 rounds to 0, so every weight whose gradient is 0 "
            "becomes NaN at the first step (8-bit AdamW gave NaN steps too, on a CPU); use model.dtype=auto "
            "(fp32 weights; train.mixed_precision=fp16 computes in fp16 on a GPU) or model.dtype=bfloat16"
        )
    if cfg.train.save_merged and not lora.r:
        raise ConfigError(
            "train.save_merged=true merges a LoRA adapter into its base (output_dir/final_merged) and "
            "needs model.lora.r > 0; without LoRA, output_dir/final is the whole model already"
        )
    if cfg.rollout.lora_sync == "merged" and m.load_in_4bit:
        raise ConfigError(
            "rollout.lora_sync=merged merges the adapter into the base, which is lossy for a 4-bit base "
            "(model.load_in_4bit=true): use rollout.lora_sync=adapter"
        )


def _check_eval(cfg: Config) -> None:
    """``eval.*``: the sets well formed and known (``grpo_fast.task.eval_sets``; whether a set can
    be read is the loader's, before the run starts), k samples that can differ."""
    from grpo_fast.task.eval_sets import check_entries

    e = cfg.eval
    if not isinstance(e.sets, (list, tuple)):
        raise ConfigError(f"eval.sets must be a list of set names, got {shown(e.sets)}")
    check_entries(cfg)
    if e.k > 1 and e.sampling_temperature(cfg.rollout.temperature) == 0:
        raise ConfigError(
            f"eval.k={e.k} with eval.temperature=0: greedy decoding gives the same answer {e.k} times; "
            "set eval.temperature above 0 (papers' pass@k: 0.6-1.0), or eval.k=1"
        )
    if e.sampling_temperature(cfg.rollout.temperature) == 0 and e.top_p != 1.0:
        said = "0" if e.temperature != AUTO else "auto (greedy at eval.k=1)"
        raise ConfigError(
            f"eval.top_p={e.top_p} with eval.temperature={said}: greedy decoding reads no top_p"
        )


def _check_train_and_loss(cfg: Config) -> None:
    t, lo = cfg.train, cfg.loss
    if cfg.eval_every and cfg.data.eval_subset_size == 0:
        raise ConfigError(
            f"data.eval_subset_size=0 with eval_every={cfg.eval_every}: the evaluation every "
            f"{cfg.eval_every} steps would evaluate no problem; set eval_every=0 to turn it off "
            "(full_eval_every evaluates the whole eval set), or a subset size above 0"
        )
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {list(t.betas)}")
    if lo.target_kl is not None and lo.beta == 0:
        raise ConfigError("loss.target_kl needs an initial loss.beta > 0 to adapt")
    if lo.kl_in_reward and lo.beta <= 0:
        raise ConfigError("loss.kl_in_reward=true needs loss.beta > 0 (the weight of the KL in the reward)")
    if lo.truncated_logprobs is True and not (cfg.rollout.top_k > 0 or cfg.rollout.top_p < 1):
        raise ConfigError(
            "loss.truncated_logprobs=true needs a truncating sampler: rollout.top_p < 1 or rollout.top_k > 0"
        )
    if lo.entropy_target is not None and not 0 <= lo.entropy_coef <= lo.entropy_coef_max:
        raise ConfigError(
            f"loss.entropy_target: the adaptive coefficient starts at loss.entropy_coef={lo.entropy_coef:g}, "
            f"which must be in [0, loss.entropy_coef_max={lo.entropy_coef_max:g}]"
        )
    _check_advantage(cfg)
    _check_distill(cfg)
    if cfg.train.fused_optimizer is True and cfg.train.optimizer != "adamw":
        raise ConfigError(
            f"train.fused_optimizer=true is torch's fused AdamW; train.optimizer={cfg.train.optimizer} is "
            "bitsandbytes' own kernel"
        )


def _check_distill(cfg: Config) -> None:
    """``distill.*`` set without a teacher; the served teacher's keys (docs/loss.md)."""
    d = cfg.distill
    if d.teacher is None:
        changed = [f.name for f in dataclasses.fields(d) if getattr(d, f.name) != f.default]
        if changed:
            raise ConfigError(f"distill.{changed[0]} configures on-policy distillation; set distill.teacher")
        return
    if d.placement == "trainer":
        for key in ("server_url", "devices"):
            if getattr(d, key) is not None:
                raise ConfigError(f"distill.{key} is for a served teacher; set distill.placement=server")
        return
    if d.load_in_4bit:
        raise ConfigError(
            "distill.load_in_4bit quantizes a teacher the trainer loads; a served teacher's "
            "quantization is its server's (distill.placement=server)"
        )
    r = cfg.rollout
    truncated = [f"rollout.{k}={v:g}" for k, v, plain in
                 (("temperature", r.temperature, 1.0), ("top_p", r.top_p, 1.0), ("top_k", r.top_k, 0))
                 if v != plain]  # fmt: skip
    if truncated:
        raise ConfigError(
            f"distill.placement=server: a served teacher's log-probs are vLLM's prompt log-probs, "
            f"at temperature 1 over the whole vocabulary, and {truncated[0]} asks the distribution "
            "the responses were sampled from; use distill.placement=trainer"
        )
    if d.server_url is not None:
        if d.devices is not None:
            raise ConfigError("distill.devices: the server at distill.server_url has its own devices")
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "distill.placement=server under torchrun: give distill.server_url (a server every rank "
            "asks); the run starts a teacher server only on one process"
        )
    if d.devices is not None and (len(set(d.devices)) != len(d.devices) or min(d.devices, default=0) < 0):
        raise ConfigError(
            f"distill.devices={list(d.devices)} must be distinct GPU indices (e.g. [1] or [2, 3])"
        )


def _check_advantage(cfg: Config) -> None:
    """``loss.advantage`` and the keys it reads or makes meaningless (docs/loss.md)."""
    lo, est = cfg.loss, cfg.loss.advantage
    if est != "gae":
        changed = [f.name for f in dataclasses.fields(cfg.critic) if getattr(cfg.critic, f.name) != f.default]
        if changed:
            raise ConfigError(
                f"critic.{changed[0]} configures the value model of loss.advantage=gae; "
                f"loss.advantage={est} has none"
            )
    if est != "group" and lo.type == "no_baseline":
        raise ConfigError(
            f"loss.advantage={est} with loss.type=no_baseline: no_baseline trains on the raw reward, "
            "no estimator's advantage; use loss.type=reinforce_with_baseline (or another) with it"
        )
    if est != "group" and cfg.data.reward_aggregation == "normalize_each":
        raise ConfigError(
            f"data.reward_aggregation=normalize_each normalizes each reward in its group (GDPO, "
            f"loss.advantage=group); with loss.advantage={est} use data.reward_aggregation=sum"
        )
    if est in PER_TOKEN_ESTIMATORS and lo.scale_rewards != "group":
        raise ConfigError(
            f"loss.scale_rewards={lo.scale_rewards} applies to loss.advantage=group and rloo; "
            f"loss.advantage={est} whitens its per-token returns over the batch (leave scale_rewards unset)"
        )
    if cfg.rollout.group_size == 1 and est in GROUP_ESTIMATORS:
        raise ConfigError(
            f"rollout.group_size=1 with loss.advantage={est}: its advantage is a response's reward "
            "against the others of its group, so a group of one never learns; use loss.advantage="
            "reinforce_pp (no group: returns whitened over the batch), or group_size >= 2"
        )
    if cfg.rollout.group_size == 1 and cfg.rollout.dynamic_sampling:
        raise ConfigError(
            "rollout.dynamic_sampling=true with rollout.group_size=1: it keeps groups whose rewards "
            "differ, and a group of one never does"
        )
    if lo.gamma != 1.0 and est not in PER_TOKEN_ESTIMATORS:
        raise ConfigError(
            f"loss.gamma={lo.gamma:g} discounts per-token returns (loss.advantage=reinforce_pp or "
            f"reinforce_pp_baseline); loss.advantage={est} gives every token its response's advantage"
        )


def _check_parallelism(cfg: Config) -> None:
    """The offload that needs ``train.parallelism=fsdp``. (LoRA, QLoRA and 8-bit AdamW run under
    FSDP: grpo_fast/policy/fsdp.py, grpo_fast/policy/sharded_optim.py.)"""
    t = cfg.train
    if t.fsdp_cpu_offload and t.parallelism != "fsdp":
        raise ConfigError(
            "train.fsdp_cpu_offload=true needs train.parallelism=fsdp (it offloads FSDP's shards)"
        )


def devices_here() -> str:
    """The values of ``device`` this machine runs, for a message: ``this machine: auto, cpu``."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = ["cuda", *(f"cuda:{i}" for i in range(n))] if n else []
    return "this machine: " + ", ".join(["auto", "cpu", *cuda])


def _check_machine(cfg: Config, preset: str | None) -> None:
    """What this machine must have: CUDA for a GPU preset or device (and the device's index), the
    backend's library, the Triton kernels' CUDA or interpreter."""
    import torch

    if (preset in GPU_PRESETS or cfg.device.startswith("cuda")) and not torch.cuda.is_available():
        what = f"preset {preset!r}" if preset in GPU_PRESETS else f"device={cfg.device!r}"
        raise ConfigError(f"{what} needs a CUDA GPU and none is available; try --preset tiny on a CPU")
    if cfg.device.startswith("cuda:") and int(cfg.device[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"device={cfg.device!r} is not on this machine ({devices_here()})")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == AUTO else cfg.device
    why_not = triton_unavailable(device.split(":")[0])
    if cfg.loss.kernel_backend == "triton" and why_not is not None:
        raise ConfigError(f"loss.kernel_backend=triton {why_not}; device={device}")
    missing = rollout_backend(cfg.rollout.backend).missing()
    if missing is not None:
        raise ConfigError(missing)
    d = cfg.distill
    if d.teacher is not None and d.placement == "server" and d.server_url is None:
        missing = rollout_backend("vllm").missing()
        if missing is not None:  # the run starts the teacher's server from this environment
            how = missing.split("needs vLLM: ", 1)[-1]
            raise ConfigError(
                f"distill.placement=server starts a vLLM server for the teacher, and vLLM is not "
                f"installed here: {how}; or attach one (distill.server_url)"
            )
        if device.startswith("cuda") and d.devices is None:
            raise ConfigError(
                "distill.placement=server on a GPU machine: give the teacher's server its GPUs "
                "(distill.devices=[1]) or attach one (distill.server_url)"
            )
    r = cfg.rollout
    if r.environment != "none" and r.tool_isolation != "unsafe":  # the sandbox: bubblewrap here
        problem = cannot_run_here(r.environment)
        if problem is not None:
            raise ConfigError(f"rollout.environment={r.environment} cannot run here: {problem}")
    for key, on in (
        ("model.load_in_4bit", cfg.model.load_in_4bit),
        ("distill.load_in_4bit", cfg.distill.load_in_4bit),
    ):
        why = nf4_unavailable(cfg.device) if on else None
        if why is not None:
            raise ConfigError(f"{key}=true: {why}")
    check_paths(cfg)
    _check_launch(cfg)


def check_paths(cfg: Config) -> None:
    """The keys that name a file or folder: a name this filesystem cannot hold (a part longer
    than 255 bytes, the whole longer than PATH_MAX) or with a NUL in it is one line here, not an
    ``OSError`` wherever it is first opened."""
    d = cfg.data
    named = (
        ("output_dir", cfg.output_dir),
        ("model.name_or_path", cfg.model.name_or_path),
        ("data.train_path", d.train_path),
        ("data.eval_path", d.eval_path),
    )
    for key, value in named:
        if value is None:
            continue
        try:
            os.stat(os.path.expanduser(value))
        except ValueError:  # a NUL character
            raise ConfigError(f"{key}={shown(value)} holds a NUL character, which no path can") from None
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                raise ConfigError(
                    f"{key}={shown(value)} is not a path this machine can open: {exc.strerror}"
                ) from None


def _check_launch(cfg: Config) -> None:
    """Under torchrun (``WORLD_SIZE`` ranks, read from the environment as
    ``grpo_fast.policy.sequence_parallel.group_size`` reads it): what those ranks must split or
    cannot share, refused here on every rank before any model loads, with the line the run's own
    later check (in ``grpo_fast.loop.setup``, ``loop.pipeline``, ``rollout.vllm``) gives."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return
    r = cfg.rollout
    n_prompts = r.prompts_per_step
    if n_prompts % world:  # each rank generates its share (under sequence parallelism too)
        raise ConfigError(
            f"rollout.batch_size / rollout.group_size = {n_prompts} prompts per step do not split "
            f"evenly over {world} ranks"
        )
    if (
        cfg.train.parallelism == "fsdp"
        and pipelined(cfg)
        and not rollout_backend(r.backend).needs_weight_push
    ):
        raise ConfigError(
            f"rollout.backend={r.backend} with rollout.max_staleness={r.max_staleness} / rollout.placement="
            f"{r.placement} samples from a whole copy of the policy, which FSDP shards: use "
            "train.parallelism=ddp, or rollout.backend=vllm with rollout.placement=server"
        )
    if rollout_backend(r.backend).needs_weight_push and fleet_size(r) > 1:
        raise ConfigError(
            f"a fleet of {fleet_size(r)} vLLM engines (rollout.num_engines / rollout.server_url) serves one "
            f"trainer process: under torchrun ({world} ranks) use one server every rank shares "
            "(rollout.placement=server, one URL), or colocated engines (one per rank)"
        )
    if r.backend == "vllm" and r.placement == "process":
        raise ConfigError(
            "rollout.placement=process starts one engine for one trainer process: under torchrun use "
            "rollout.placement=server (one server every rank shares, on rollout.engine_devices) or "
            "colocated (one engine per rank)"
        )


def nf4_unavailable(device: str) -> str | None:
    """Why bitsandbytes cannot serve a 4-bit NF4 base on ``device`` (``cfg.device``), or None.

    bitsandbytes ≥ 0.50 runs NF4 ``Linear4bit`` on CUDA and on the CPU (checked here: forward,
    backward and a peft LoRA step of a tiny Qwen2 in NF4); other devices (mps, ...) it does not.
    """
    import importlib.metadata
    import importlib.util

    import torch

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install 'bitsandbytes>=0.50')"
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == AUTO else device.split(":")[0]
    if kind not in ("cuda", "cpu"):
        return f"bitsandbytes has no 4-bit kernels for device={device!r} (CUDA or CPU)"
    version = importlib.metadata.version("bitsandbytes")
    major, minor = (int(x) for x in version.split(".")[:2])
    if kind == "cpu" and (major, minor) < (0, 50):
        return f"bitsandbytes {version} has no CPU 4-bit kernels; bitsandbytes >= 0.50 has"
    return None


def _check_reward(d: DataConfig) -> None:
    """``data.reward``: a non-empty name or a list of distinct ones; ``data.reward_weights``: one
    number per listed reward. Whether each name exists is checked by ``grpo_fast.task.loader.load_task``
    (the registry fills as modules import)."""
    names = d.reward if isinstance(d.reward, list) else [d.reward]
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"data.reward must be a reward name or a non-empty list of names, got {d.reward!r}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"data.reward lists {repeated[0]!r} twice")
    if d.reward_weights is not None:
        if not isinstance(d.reward, list):
            raise ConfigError("data.reward_weights needs data.reward to be a list (one weight per reward)")
        if len(d.reward_weights) != len(names):
            raise ConfigError(
                f"data.reward_weights has {len(d.reward_weights)} weights for the {len(names)} rewards "
                f"of data.reward"
            )


def _check_prompt_template(d: DataConfig) -> None:
    """``data.prompt_template``: a registered name or a string holding ``{question}``."""
    try:
        get_template(d.prompt_template)
    except ConfigError as exc:
        raise ConfigError(f"data.prompt_template: {exc}") from None


def _numeric_leaves(cfg: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Every number in ``cfg`` as ``(dotted key, value)``: numeric fields, each element of a tuple
    (``train.betas[0]``) and each value of a dict (``health.thresholds.X``); bools are not numbers."""
    found: list[tuple[str, float]] = []

    def add(key: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found.append((key, value))

    for f in dataclasses.fields(cfg):
        key, value = f"{prefix}{f.name}", getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            found.extend(_numeric_leaves(value, key + "."))
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                add(f"{key}[{i}]", v)
        elif isinstance(value, dict):
            for k, v in value.items():
                add(f"{key}.{k}", v)
        else:
            add(key, value)
    return found
