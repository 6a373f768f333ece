"""Where a vLLM engine apart from the trainer runs (``rollout.placement=process|server``): an
``AsyncLLM`` engine in a process of its own (``placement/process.py``), a server the run starts
on 127.0.0.1 or attaches to at ``rollout.server_url`` (``placement/server.py``), and under
torchrun one server for every rank (``shared_server``: rank 0 starts or attaches, the others
follow it, ``placement/ranks.py``). ``grpo_fast.rollout.vllm.backend._build`` picks one;
``VLLMBackend`` drives it."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch

from grpo_fast.domains import AUTO
from grpo_fast.errors import ConfigError
from grpo_fast.rollout import multi_turn
from grpo_fast.rollout.vllm.placement.ranks import RankShare


def shared_server(cfg, path: str, dtype: str, lora_rank: int, rank: int):
    """(this rank's engine, its ``RankShare``) for one server every torchrun rank uses: rank 0's
    ``engine_apart``, the others' a follower of its URL; on GPUs a server the run starts must not
    take a trainer rank's GPU."""
    _check_disjoint(cfg.rollout)
    # the pushes' barrier and outcome go over a gloo group of their own (a collective: every rank
    # builds its backend at the same point of setup), so that a push from the pipeline's producer
    # thread never interleaves with the trainers' collectives; its wait: a rank finishing its
    # batch, then the leader's push
    r = cfg.rollout
    limit = timedelta(seconds=r.request_timeout + r.sync_timeout + 60)
    ranks = RankShare(rank, torch.distributed.new_group(backend="gloo", timeout=limit))
    engine = ranks.attach(
        lambda: engine_apart(cfg, path, dtype, lora_rank), lambda url: _follower(cfg, url, dtype)
    )
    return engine, ranks


def engine_apart(cfg, path: str, dtype: str, lora_rank: int, index: int | None = None):
    """A ``ProcessEngine`` or ``ServerEngine`` (started here, or attached at ``rollout.server_url``);
    ``index``: engine ``index`` of a fleet (its URL and devices; a server's log
    ``vllm_server.<index>.log``), None for the run's one engine."""
    from grpo_fast.rollout.fleet import engine_device_lists, engine_urls, fleet_size
    from grpo_fast.rollout.vllm.placement.shared import fleet_cpus
    from grpo_fast.rollout.vllm.transfer.transport import free_port

    r = cfg.rollout
    url = engine_urls(r)[index or 0]
    devices = engine_device_lists(r)[index or 0]
    timeouts = _timeouts(r)
    common = dict(
        max_model_len=r.max_prompt_tokens + multi_turn.max_response_tokens(r), seed=cfg.seed, dtype=dtype
    )
    memory = 0.9 if r.gpu_memory_utilization == AUTO else float(r.gpu_memory_utilization)
    # a fleet on a CPU: each engine's OpenMP threads on cores of their own (fleet_cpus)
    cpus = None if index is None or torch.cuda.is_available() else fleet_cpus(index, fleet_size(r))
    if r.placement == "process":
        from grpo_fast.rollout.vllm.placement.process import ProcessEngine

        return ProcessEngine(path, timeouts=timeouts, gpu_memory_utilization=memory, extra_args=dict(r.vllm_kwargs),
                             lora_rank=lora_rank, weight_transfer=r.weight_transfer, devices=devices, cpus=cpus,
                             **common)  # fmt: skip
    from grpo_fast.rollout.vllm.placement.server import ServerEngine, server_command, start_server

    process = None
    if url is None:
        port = free_port()
        command = server_command(path, port, gpu_memory_utilization=memory, lora_rank=lora_rank, devices=devices,
                                 weight_transfer=r.weight_transfer, extra_args=dict(r.vllm_kwargs),
                                 cpu=not torch.cuda.is_available(), **common)  # fmt: skip
        process = start_server(
            command,
            port,
            Path(cfg.output_dir) / ("vllm_server.log" if index is None else f"vllm_server.{index}.log"),
            timeouts,
            lora=bool(lora_rank),
            devices=devices,
            cpus=cpus,
        )
    elif index is not None:  # a fleet's listed server: it may be starting, or coming back
        from grpo_fast.rollout.vllm.deadline import Deadline
        from grpo_fast.rollout.vllm.placement.server import wait_listening

        wait_listening(url, Deadline(r.start_timeout, f"the vLLM server at {url}", "rollout.start_timeout"))
    try:
        return ServerEngine(process.url if process else url, timeouts=timeouts, dtype=dtype, process=process,
                            weight_transfer=r.weight_transfer)  # fmt: skip
    except BaseException:
        if process is not None:
            process.stop()
        raise


def _check_disjoint(r) -> None:
    """Under torchrun on GPUs, a server the run starts takes GPUs no trainer rank uses: local
    rank i trains on GPU i (``grpo_fast.dist.init``)."""
    if r.server_url is not None or not torch.cuda.is_available():
        return
    trainers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    from grpo_fast.rollout.fleet import engine_device_lists

    devices = engine_device_lists(r)[0]
    shared = sorted(set(devices or [0]) & set(range(trainers)))
    if shared:
        which = " unset: GPU 0" if devices is None else f"={devices}"
        raise ConfigError(
            f"the vLLM server would run on GPU(s) {shared} (rollout.engine_devices{which}), which the "
            f"{trainers} trainer ranks use (local rank i trains on GPU i): give it GPUs of its own, e.g. "
            f"rollout.engine_devices=[{trainers}]"
        )


def _follower(cfg, url: str, dtype: str):
    """A trainer rank's view of the server rank 0 started or attached to (``placement/ranks.py``)."""
    from grpo_fast.rollout.vllm.placement.server import ServerEngine

    r = cfg.rollout
    return ServerEngine(
        url, timeouts=_timeouts(r), dtype=dtype, weight_transfer=r.weight_transfer, follower=True
    )


def _timeouts(r):
    from grpo_fast.rollout.vllm.deadline import Timeouts

    return Timeouts(start=r.start_timeout, request=r.request_timeout, sync=r.sync_timeout)
