"""Configuration: frozen dataclasses hold every default and its domain once; presets, YAML files
and ``key=value`` overrides are layered on top, in that order.

    defaults (the dataclasses below)
      ← preset (``PRESETS[name]``: only what differs from the defaults)
      ← ``--config a.yaml --config b.yaml`` (later files win)
      ← ``key=value`` dot-list overrides (OmegaConf syntax: ``train.lr=3e-6``)

Each field is declared as ``option(default, domain)`` (``grpo_fast.domains``): ``validate``
(``grpo_fast.config_checks``) walks the table and names the first key out of its domain, then
checks the relations between keys.
``loss.*`` is ``LossConfig``, which extends ``LossOptions`` (``grpo_fast.algo.loss_options``):
the loss options' defaults and domains are written there, once. ``rollout.backend`` is one of
the backends the registry finds (``grpo_fast.rollout.registry``), each with its own checks.

``load_config`` validates the result and raises ``ConfigError`` with one line naming the key
at fault (an unknown key comes with the nearest valid name). ``"auto"`` values are resolved
at run time by the memory planner (``grpo_fast.tools.plan``) or by the device.

The sections' dataclasses (``RolloutConfig``, ``TrainConfig``, ...) are written in
``grpo_fast.config_sections`` and exported from here under the same names; this module assembles
them into ``Config`` and holds the loading, the resume classes and the YAML round trip.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from grpo_fast.config_checks import devices_here, validate
from grpo_fast.config_parse import (
    MERGE_ERRORS,
    all_keys,
    check_keys,
    dotlist_to_tree,
    flatten,
    is_section,
    load_yaml,
    omegaconf_error,
    too_large,
)
from grpo_fast.config_sections import (
    _REPLACED_KEYS,
    MAX_SEQUENCES,
    MAX_STEPS,
    MAX_TOKENS,
    CriticConfig,
    DataConfig,
    DistillConfig,
    EvalConfig,
    HealthConfig,
    LoggingConfig,
    LoRAConfig,
    LossConfig,
    ModelConfig,
    RolloutConfig,
    SFTConfig,
    ThreadsConfig,
    TrainConfig,
    _steps,
)
from grpo_fast.domains import AUTO, RESUME_CLASSES, Pattern, Range, option
from grpo_fast.errors import ConfigError
from grpo_fast.presets import PRESET_SUMMARIES, PRESETS, Preset

__all__ = [
    "AUTO",
    "MAX_SEQUENCES",
    "MAX_STEPS",
    "MAX_TOKENS",
    "PRESETS",
    "PRESET_SUMMARIES",
    "Config",
    "CriticConfig",
    "DataConfig",
    "DistillConfig",
    "EvalConfig",
    "HealthConfig",
    "LoRAConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "Preset",
    "RolloutConfig",
    "SFTConfig",
    "ThreadsConfig",
    "TrainConfig",
    "config_sources",
    "load_config",
    "presets_and_keys_help",
    "validate",
]


@dataclass(frozen=True)
class Config:
    output_dir: str = option("runs/grpo", resume="safe")
    seed: int = option(0, Range(0, 2**32 - 1, integer=True, hi_why=": numpy's seeds are 32-bit"))
    steps: int = option(200, _steps(1), resume="safe")
    # subset evaluation (data.eval_subset_size problems); 0 = never
    eval_every: int = option(10, _steps(0), resume="safe")
    full_eval_every: int = option(50, _steps(0), resume="safe")  # the whole eval set; 0 = never
    checkpoint_every: int = option(50, _steps(0), resume="safe")  # 0 = only the final model
    keep_checkpoints: int = option(2, _steps(1), resume="safe")
    # continue the run in output_dir from its latest checkpoint (the run-defining keys of
    # ON_RESUME must match its config.yaml)
    resume: bool = option(False, resume="safe")
    # a fresh run into an output_dir that holds a run deletes that run's files first
    # (grpo_fast.obs.run_folder.RUN_FILES); without it such a run stops, naming what is there
    overwrite: bool = option(False, resume="safe")
    # auto | cpu | cuda | cuda:N (this machine's are checked with it: config_checks.devices_here)
    device: str = option(
        AUTO,
        Pattern(r"auto|cpu|cuda(:(0|[1-9][0-9]{0,3}))?", "auto, cpu, cuda, cuda:N", devices_here),
        resume="safe",
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    threads: ThreadsConfig = field(default_factory=ThreadsConfig)


# The parsing helpers (grpo_fast.config_parse) under the names this module's callers import.
_is_section = is_section


def _all_keys() -> list[str]:
    """Every key of ``Config`` (sections and leaves), dotted."""
    return all_keys(Config)


def resume_class(key: str) -> str:
    """What ``resume=true`` may do with config key ``key`` (grpo_fast.obs.run_folder.check_resume):
    ``"run"``: it defines what the run's metrics mean (model, data, task, reward, sizes, seed,
    loss, rollout and warm-start options): a resume must keep the run's value, or it stops naming
    it; ``"safe"``: how long, how often, where, how fast, what is logged: a resume may change it,
    and config.yaml records the change. Declared beside each default (``option(..., resume=)``),
    else the section's ``RESUME`` (``LoggingConfig``: all safe), else ``"run"``: a new key is
    run-defining until someone says otherwise."""
    cls, parts = Config, key.split(".")
    for i, name in enumerate(parts):
        f = {f.name: f for f in dataclasses.fields(cls)}[name]
        if "resume" in f.metadata:
            return f.metadata["resume"]
        if is_section(f) and i + 1 < len(parts):
            cls = type(f.default_factory())
            continue
        return getattr(cls, "RESUME", "run")
    raise KeyError(key)


def _resume_table() -> dict[str, tuple[str, ...]]:
    classes = {k: resume_class(k) for k in _all_keys() if not _is_section_key(k)}
    return {c: tuple(k for k, v in classes.items() if v == c) for c in RESUME_CLASSES}


def presets_and_keys_help() -> str:
    """The presets and every config key by section (from the dataclasses: one source of truth)."""
    lines = ["presets (--preset):"]
    lines += [f"  {name:<9} {preset.summary}" for name, preset in PRESETS.items()]
    lines += ["", "config keys (key=value, e.g. train.lr=3e-6; see grpo_fast/config_sections.py):"]
    top = [f.name for f in dataclasses.fields(Config) if not dataclasses.is_dataclass(f.default_factory)]
    lines.append(f"  {'(top)':<9} {' '.join(top)}")
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(f.default_factory):
            names = [g.name for g in dataclasses.fields(f.default_factory)]
            lines.append(f"  {f.name:<9} {' '.join(names)}")
    return "\n".join(lines)


@functools.cache
def _defaults() -> Any:
    """The defaults as an OmegaConf structured config (built once: merging copies it)."""
    return OmegaConf.structured(Config)


def shares_prompts(cfg: Config) -> bool:
    """``train.share_prompts`` as the run applies it: ``auto`` is on, except where the model was
    asked for flash-attention 2 (``model.attn_implementation=flash_attention_2``), which the shared
    forward does not wrap (grpo_fast/policy/shared_attention.py)."""
    share = cfg.train.share_prompts
    return share if isinstance(share, bool) else cfg.model.attn_implementation != "flash_attention_2"


def load_config(
    preset: str | None = None,
    config_files: list[str] | None = None,
    overrides: list[str] | None = None,
    *,
    check_device: bool = True,
) -> Config:
    """Layer defaults ← preset ← YAML files ← dot-list overrides, then validate.

    Example:
        >>> cfg = load_config("tiny", overrides=["train.lr=1e-4", "steps=10"])
        >>> cfg.train.lr, cfg.steps
        (0.0001, 10)
    """
    layers: list[tuple[str, dict, str]] = []
    if preset is not None:
        if preset not in PRESETS:
            near = difflib.get_close_matches(preset, list(PRESETS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown preset {preset!r}{hint}; presets: {', '.join(PRESETS)}")
        layers.append((f"preset {preset!r}", dict(PRESETS[preset]), "?"))
    for path in config_files or []:
        layers.append((f"config file {path}", load_yaml(path), "?"))
    for key, tree in dotlist_to_tree(overrides or [], Config):
        layers.append((f"override {key}=...", tree, key))

    merged = _defaults()
    for where, tree, key in layers:
        check_keys(tree, Config, where, _REPLACED_KEYS)
        try:
            merged = OmegaConf.merge(merged, tree)
        except MERGE_ERRORS as exc:
            huge = too_large(tree) if isinstance(exc, OverflowError) else None
            raise omegaconf_error(exc, where, huge or key) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except MERGE_ERRORS as exc:
        raise omegaconf_error(exc, "the merged config") from None
    cfg = _freeze(cfg)
    validate(cfg, preset, check_device=check_device)
    return cfg


def config_sources(
    preset: str | None = None,
    config_files: list[str] | None = None,
    overrides: list[str] | None = None,
    *,
    check_device: bool = True,
) -> dict[str, tuple[Any, str]]:
    """Every leaf key of the resolved config → ``(value, where it came from)``: ``"default"``,
    ``"preset NAME"``, ``"file PATH"`` or ``"override"`` (the last layer that set it wins, as in
    ``load_config``, which this calls first: a bad layer raises the same ``ConfigError``).

    Example:
        >>> src = config_sources("tiny", overrides=["steps=10"])
        >>> src["steps"], src["seed"], src["train.lr"]
        ((10, 'override'), (0, 'default'), (0.0002, 'preset tiny'))
    """
    cfg = load_config(preset, config_files, overrides, check_device=check_device)
    sources: dict[str, str] = {}
    if preset is not None:
        sources.update(dict.fromkeys(flatten(PRESETS[preset], Config), f"preset {preset}"))
    for path in config_files or []:
        sources.update(dict.fromkeys(flatten(load_yaml(path), Config), f"file {path}"))
    for _, tree in dotlist_to_tree(overrides or [], Config):
        sources.update(dict.fromkeys(flatten(tree, Config), "override"))
    return {k: (v, sources.get(k, "default")) for k, v in flatten(dataclasses.asdict(cfg), Config).items()}


def _freeze(cfg: Config) -> Config:
    """OmegaConf turns tuples into lists; restore the dataclass field types that matter. YAML 1.1
    reads a bare ``no`` as false, so ``train.mixed_precision=no`` arrives as ``"False"``."""
    mp = "no" if cfg.train.mixed_precision == "False" else cfg.train.mixed_precision
    train = dataclasses.replace(cfg.train, betas=tuple(float(b) for b in cfg.train.betas), mixed_precision=mp)
    return dataclasses.replace(cfg, train=train)


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what ``output_dir/config.yaml`` holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def _is_section_key(key: str) -> bool:
    cls, parts = Config, key.split(".")
    for name in parts[:-1]:
        cls = type({f.name: f for f in dataclasses.fields(cls)}[name].default_factory())
    return is_section({f.name: f for f in dataclasses.fields(cls)}[parts[-1]])


# Every leaf key by resume class, from the declarations (``resume_class``): what run_folder reads.
ON_RESUME: dict[str, tuple[str, ...]] = _resume_table()
