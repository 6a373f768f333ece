"""The rollout's checks (``grpo_fast.config_checks.validate`` runs them, in this order): the
relations between rollout keys and each backend's own checks, then where the engine runs
(``rollout.placement``, a server's URL, an engine's devices), then the pipeline and the fleet
(``rollout.max_staleness``, ``rollout.num_engines``), then the tool environment. ``pipelined``: whether
a run trains through the pipeline. Each raises ``ConfigError`` with one line naming the key at fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_fast.domains import AUTO
from grpo_fast.env.registry import environment as environment_spec
from grpo_fast.errors import ConfigError, shown
from grpo_fast.rollout.fleet import fleet_size
from grpo_fast.rollout.registry import backend as rollout_backend
from grpo_fast.rollout.registry import backends as rollout_backends

if TYPE_CHECKING:  # grpo_fast.config imports config_checks, which imports this module
    from grpo_fast.config import Config


def check_rollout(cfg: Config) -> None:
    """The relations between rollout keys, and the backend's own checks and capabilities."""
    r = cfg.rollout
    if r.batch_size % r.group_size:
        raise ConfigError(
            f"rollout.batch_size={r.batch_size} is not a multiple of rollout.group_size={r.group_size}"
        )
    if r.min_tokens > r.max_tokens:
        raise ConfigError(f"rollout.min_tokens={r.min_tokens} exceeds rollout.max_tokens={r.max_tokens}")
    spec = rollout_backend(r.backend)
    if not spec.sampler_logprobs:
        for key, on in (("is_correction", r.is_correction), ("old_logprobs", r.old_logprobs == "sampler")):
            if on:
                having = " or ".join(
                    f"rollout.backend={n}" for n, b in rollout_backends().items() if b.sampler_logprobs
                )
                raise ConfigError(
                    f"rollout.{key}={getattr(r, key)} needs the sampler's log-probs, which "
                    f"rollout.backend={r.backend} does not return: use {having}"
                )
    for other in rollout_backends().values():  # each checks the keys it owns, chosen or not
        other.check_config(cfg)
    if r.old_logprobs == "sampler" and r.is_correction:
        raise ConfigError(
            "rollout.is_correction=true needs π_old from the trainer: with rollout.old_logprobs=sampler "
            "the clipped ratio is already taken against the sampler"
        )
    if r.difficulty_filter is not None:
        band = list(r.difficulty_filter)
        if len(band) != 2 or not 0 <= band[0] <= band[1] <= 1:
            raise ConfigError(
                f"rollout.difficulty_filter must be [lo, hi] with 0 <= lo <= hi <= 1 (or null), got {band}"
            )
    if r.max_group_size < r.min_group_size:
        raise ConfigError(
            f"rollout.max_group_size={r.max_group_size} is below rollout.min_group_size={r.min_group_size}"
        )
    if r.adaptive_group_size and not r.min_group_size <= r.group_size <= r.max_group_size:
        raise ConfigError(
            f"rollout.adaptive_group_size=true needs rollout.min_group_size={r.min_group_size} <= "
            f"rollout.group_size={r.group_size} <= rollout.max_group_size={r.max_group_size}"
        )
    if cfg.data.overlong_buffer >= r.max_tokens:
        raise ConfigError(
            f"data.overlong_buffer={cfg.data.overlong_buffer} must be below rollout.max_tokens={r.max_tokens}"
        )
    _check_placement(cfg)
    _check_pipeline(cfg)
    _check_tools(cfg)


def _check_tools(cfg: Config) -> None:
    """``rollout.environment`` names an environment; the caps agree; the keys that act on tool
    calls have an environment to act on."""
    r = cfg.rollout
    if r.environment == "none":
        for key, on in (
            ("data.tool_error_penalty", cfg.data.tool_error_penalty > 0),
            ("loss.mask_void_turns", cfg.loss.mask_void_turns),
        ):
            if on:
                raise ConfigError(
                    f"{key} acts on tool calls and needs a tool environment: set rollout.environment "
                    "(python, calculator, or your module's import path)"
                )
        return
    if pipelined(cfg):  # the pipeline's producers (hf thread or worker process) sample one turn
        raise ConfigError(
            f"rollout.environment={r.environment} runs lockstep in this build: set rollout.max_staleness=0 "
            "(and for rollout.backend=hf, rollout.placement=colocated)"
        )
    try:
        environment_spec(r.environment)
    except ConfigError as exc:
        raise ConfigError(f"rollout.environment: {exc}") from None
    if r.max_response_tokens != AUTO and r.max_response_tokens < r.max_tokens:
        raise ConfigError(
            f"rollout.max_response_tokens={r.max_response_tokens} (sampled + inserted tokens) is below "
            f"rollout.max_tokens={r.max_tokens} (the sampled tokens alone): raise it, or lower max_tokens"
        )


def pipelined(cfg: Config) -> bool:
    """Whether the run trains through the pipeline (``grpo_fast.loop.pipeline``: a producer apart
    from the trainer, a queue between them): with ``rollout.max_staleness > 0``, or with a backend
    that samples from the training model (hf) placed in a process of its own."""
    r = cfg.rollout
    own_weights = rollout_backend(r.backend).needs_weight_push
    return r.max_staleness > 0 or (r.placement == "process" and not own_weights)


def _check_engine_devices(r) -> None:
    """``rollout.engine_devices``: distinct GPU indices, one list per engine of a fleet."""
    devices = list(r.engine_devices)
    size = fleet_size(r)
    nested = bool(devices) and all(isinstance(x, list) for x in devices)
    lists = [list(x) for x in devices] if nested else [devices]
    flat = [d for x in lists for d in x]
    if (
        not devices
        or any(not x for x in lists)
        or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in flat)
        or len(set(flat)) < len(flat)
    ):
        raise ConfigError(
            "rollout.engine_devices must be distinct GPU indices (e.g. [1] or [2, 3]; a fleet: one list "
            f"per engine, e.g. [[1], [2]]), got {devices}"
        )
    if len(lists) != size:
        raise ConfigError(
            f"rollout.engine_devices gives {len(lists)} device list(s) for {size} engine(s): a fleet takes "
            "one list per engine, e.g. rollout.engine_devices=[[1], [2]]"
        )
    if r.server_url is not None:
        raise ConfigError(
            "rollout.engine_devices is for a server the run starts; the server at rollout.server_url has its own"
        )


def _check_pipeline(cfg: Config) -> None:
    """``rollout.placement`` for the hf backend, ``rollout.max_staleness`` and what the pipeline
    does not run with."""
    r = cfg.rollout
    own_weights = rollout_backend(r.backend).needs_weight_push
    if r.max_staleness > 0 and own_weights and r.placement == "colocated":
        raise ConfigError(
            f"rollout.max_staleness={r.max_staleness} with rollout.backend={r.backend} needs the engine apart "
            "from the trainer: rollout.placement=process|server (a colocated engine shares the trainer's "
            "process and device, so generation cannot run while it trains)"
        )
    if r.placement == "process" and not own_weights and cfg.device.startswith("cuda"):
        raise ConfigError(
            f"rollout.placement=process runs the hf decoder on CPU cores of its own: device=cpu "
            f"(got device={cfg.device})"
        )
    if r.worker_threads != AUTO and (r.placement != "process" or own_weights):
        raise ConfigError(
            f"rollout.worker_threads is for rollout.placement=process with rollout.backend=hf (the hf "
            f"decoder's worker process; got placement={r.placement}, backend={r.backend})"
        )
    size = fleet_size(r)
    if r.min_engines > size:
        raise ConfigError(
            f"rollout.min_engines={r.min_engines} is above the fleet's {size} engine(s) "
            f"(rollout.num_engines={r.num_engines}"
            + (f", rollout.server_url: {size} URL(s)" if isinstance(r.server_url, list) else "")
            + "): the run could never start"
        )
    if size > 1 or r.min_engines > 1:
        fleet = f"rollout.num_engines={size} / rollout.min_engines={r.min_engines}"
        if not (r.placement == "process" or (own_weights and r.placement == "server")):
            raise ConfigError(
                f"{fleet} is a fleet of engines apart from the trainer: rollout.placement=process (hf "
                f"workers or vLLM engines) or server (vLLM servers); got backend={r.backend}, "
                f"placement={r.placement}"
            )
        if own_weights and r.weight_transfer == "nccl":
            raise ConfigError(
                f"{fleet} with rollout.weight_transfer=nccl: a fleet loads every engine through the "
                "shared-memory transfer (weight_transfer=shm, the engines on this machine); one NCCL "
                "group over several engines is not in this build"
            )
    if r.max_staleness > 0 and not (r.is_correction or r.old_logprobs == "sampler"):
        raise ConfigError(
            f"rollout.max_staleness={r.max_staleness} trains on batches sampled by an older policy and "
            "needs an off-policy correction against the sampler's log-probs: rollout.is_correction=true "
            "(TIS/MIS weights, rollout.is_mode) or rollout.old_logprobs=sampler (the clipped ratio)"
        )
    if not pipelined(cfg):
        return
    if r.dynamic_sampling:
        raise ConfigError(
            "rollout.dynamic_sampling=true runs extra generation rounds inside a step, which the "
            "pipeline (rollout.max_staleness > 0 or rollout.placement=process) does not: turn one off"
        )
    by_rate = r.curriculum != "none" and cfg.data.difficulty_field is None
    reads_rates = [
        ("rollout.adaptive_group_size=true", r.adaptive_group_size),
        ("rollout.difficulty_filter", r.difficulty_filter is not None),
        (f"rollout.curriculum={r.curriculum} without data.difficulty_field", by_rate),
    ]
    for what, on in reads_rates:
        if on and r.max_staleness > 0:
            raise ConfigError(
                f"{what} has the producer read the pass rates the trainer records, which with "
                f"rollout.max_staleness={r.max_staleness} run at the same time: use rollout.max_staleness=0"
            )


def _check_placement(cfg: Config) -> None:
    """``rollout.placement`` and the keys that only mean something with an engine apart."""
    r = cfg.rollout
    own_weights = rollout_backend(r.backend).needs_weight_push
    apart = r.placement != "colocated" and own_weights  # an engine apart: vllm process | server
    if r.placement == "server" and not own_weights:
        raise ConfigError(
            f"rollout.placement=server is a vLLM server (rollout.backend=vllm); rollout.backend={r.backend} "
            "runs colocated or in a worker process (rollout.placement=process)"
        )
    if r.server_url is not None:
        if r.placement != "server":
            raise ConfigError(
                f"rollout.server_url is for rollout.placement=server (got placement={r.placement})"
            )
        urls = r.server_url if isinstance(r.server_url, list) else [r.server_url]
        for url in urls:
            scheme, _, rest = str(url).partition("://")
            host, _, port = rest.rstrip("/").rpartition(":")
            if (
                not isinstance(url, str)
                or scheme not in ("http", "https")
                or not host
                or not port.isdigit()
                or "/" in rest.rstrip("/")
            ):
                raise ConfigError(
                    "rollout.server_url must be http://HOST:PORT (a vLLM server's base URL) or a list of "
                    f"them (a fleet), got {shown(url)}"
                )
        if not urls or len({str(u).rstrip("/") for u in urls}) < len(urls):
            raise ConfigError(
                f"rollout.server_url lists each server once (a fleet of distinct servers), got {urls}"
            )
        if len(urls) > 1 and r.num_engines not in (1, len(urls)):
            raise ConfigError(
                f"rollout.num_engines={r.num_engines} with {len(urls)} servers in rollout.server_url: "
                "the fleet is the servers listed (leave rollout.num_engines at 1, or set it to their count)"
            )
    if not apart:
        for key, value, default in (
            ("weight_transfer", r.weight_transfer, "shm"),
            ("engine_devices", r.engine_devices, None),
        ):
            if value != default:
                raise ConfigError(
                    f"rollout.{key} is for rollout.placement=process or server with rollout.backend=vllm "
                    f"(got placement={r.placement}, backend={r.backend})"
                )
    if r.engine_devices is not None:
        _check_engine_devices(r)
    if r.weight_transfer == "nccl" and not r.engine_devices:
        raise ConfigError(
            "rollout.weight_transfer=nccl broadcasts from the trainer's GPU to the engine's: set rollout.engine_devices "
            "to GPUs the trainer does not use (NCCL needs one GPU per rank)"
        )
