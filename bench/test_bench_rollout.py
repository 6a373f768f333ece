"""Rollout throughput of the two backends on the same tiny work, on CPU: the hf backend's own
decoding (``hf``: each prompt prefilled once, one uniform per row and token), transformers
``generate(num_return_sequences=G)`` as the hf backend ran it before (``transformers generate``),
and the real vLLM engine (``vllm``, in-process, fp32, as ``rollout.backend=vllm`` runs it, with the
tiny preset's ``rollout.vllm_kwargs``).

The work: the tiny preset's model (random init, seed 0), 32 prompts of the tiny task × 8 samples
each, exactly 16 generated tokens per sample (``min_tokens = max_tokens``, so both backends
generate the same number of tokens), temperature 1. ``tokens_per_s`` counts generated tokens.
The ``vllm`` case needs vLLM (``make setup-vllm``; run this file with that environment's python
to have both rows in one JSON).
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.task import tiny

PROMPTS, GROUP, TOKENS, ROUNDS = 32, 8, 16, 5


def _work():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    prompts = [tok(e.question)["input_ids"] for e in tiny.examples("eval")[:PROMPTS]]
    params = SamplingParams(n=GROUP, temperature=1.0, top_p=1.0, max_tokens=TOKENS, min_tokens=TOKENS, seed=0)
    return tok, model, prompts, params


def _record(benchmark, impl: str, generated: int) -> None:
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        impl=impl,
        case=f"tiny model: {PROMPTS} prompts × {GROUP} samples × {TOKENS} tokens, fp32",
        tokens=generated,
        tokens_per_s=generated / median,
        load_average_1m=os.getloadavg()[0],
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
        command=(
            ".venv-vllm/bin/python -m pytest bench/test_bench_rollout.py -p no:cacheprovider "
            "--benchmark-json bench/results/rollout-cpu-$(date -u +%F).json  # make setup-vllm first"
        ),
    )


def _bench(benchmark, backend, prompts, params, impl: str) -> None:
    out: list[int] = []
    backend.generate(prompts, params)  # warm-up
    benchmark.pedantic(
        lambda: out.append(backend.generate(prompts, params).num_response_tokens), rounds=ROUNDS
    )
    assert out[-1] == PROMPTS * GROUP * TOKENS  # both backends generate exactly the same count
    _record(benchmark, impl, out[-1])


@pytest.mark.benchmark(group="rollout-cpu")
def test_rollout_hf_cpu(benchmark):
    tok, model, prompts, params = _work()
    _bench(benchmark, HFBackend(model, tok, generation_batch_size=PROMPTS * GROUP), prompts, params, "hf")


def _long_work():
    """The long-response decode: a random 6-layer Qwen2 (D 512, MLP 1,408, 8 heads over 4 KV heads,
    V = 32,768, tied), 8 prompts of 48-63 random tokens × 4 samples, exactly 128 tokens each."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32768, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(48, 64, (8,), generator=g).tolist()
    prompts = [torch.randint(2, 32768, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=128, min_tokens=128, seed=0)
    return _IdsOnly(), model, prompts, params


class _IdsOnly:
    """A tokenizer stand-in for random ids: pad 0, EOS 1, no text."""

    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows, skip_special_tokens=True):
        return [""] * len(rows)


@pytest.mark.benchmark(group="rollout-decoder-cpu")
@pytest.mark.parametrize(
    "variant",
    [pytest.param("hf", id="hf"), pytest.param("hf, transformers' cache and sdpa", id="hf-before")],
)
@pytest.mark.parametrize("workload", ["tiny", "long"])
def test_rollout_hf_decoder_parts_cpu(benchmark, monkeypatch, workload, variant):
    """The hf decoder as it runs (its preallocated KV cache, ``grpo_fast.rollout.hf.cache``; its
    one-query attention for decode steps, ``hf/attention.py``) against itself with both taken out
    (transformers' growing ``DynamicCache`` and its sdpa): the tiny work above, and a long decode
    (``_long_work``). The same tokens are drawn either way (seeded)."""
    import contextlib

    import grpo_fast.rollout.hf.decoder as decoder

    if variant != "hf":
        monkeypatch.setattr(decoder, "decode_cache", lambda model, capacity: None)
        monkeypatch.setattr(decoder, "decode_steps", lambda model: contextlib.nullcontext())
    tok, model, prompts, params = _work() if workload == "tiny" else _long_work()
    backend = HFBackend(model, tok, generation_batch_size=len(prompts) * params.n)
    out: list[int] = []
    backend.generate(prompts, params)  # warm-up
    rounds = ROUNDS if workload == "tiny" else 3
    benchmark.pedantic(
        lambda: out.append(backend.generate(prompts, params).num_response_tokens), rounds=rounds
    )
    assert out[-1] == len(prompts) * params.n * params.max_tokens
    _record(benchmark, variant, out[-1])
    shape = (
        "tiny model: 32 prompts × 8 × 16 tokens"
        if workload == "tiny"
        else "6 layers, D 512: 8 prompts × 4 × 128 tokens"
    )
    benchmark.extra_info["case"] = f"{shape}, fp32"
    benchmark.extra_info["command"] = (
        "python -m pytest bench/test_bench_rollout.py -k decoder_parts -p no:cacheprovider "
        "--benchmark-json bench/results/rollout-decoder-cpu-$(date -u +%F).json"
    )


class _TransformersGenerate:
    """The hf backend before issue 24: ``model.generate(num_return_sequences=G)`` (each prompt
    prefilled G times, one exponential per vocabulary entry and token in ``torch.multinomial``)."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    @torch.no_grad()
    def generate(self, prompts, params):
        from grpo_fast.rollout.base import Rollout

        width = max(map(len, prompts))
        ids = torch.tensor([[self.tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = (ids != self.tok.pad_token_id).long()
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens,
            num_return_sequences=params.n, do_sample=True, temperature=params.temperature, top_p=params.top_p,
            top_k=0, pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id,
        )[:, width:].tolist()  # fmt: skip
        return Rollout([list(p) for p in prompts], out, [""] * len(out), ["length"] * len(out))


@pytest.mark.benchmark(group="rollout-cpu")
def test_rollout_transformers_generate_cpu(benchmark):
    tok, model, prompts, params = _work()
    _bench(benchmark, _TransformersGenerate(model.eval(), tok), prompts, params, "transformers generate")


@pytest.mark.vllm
@pytest.mark.benchmark(group="rollout-cpu")
def test_rollout_vllm_cpu(benchmark, tmp_path):
    import vllm

    from grpo_fast.rollout.vllm import VLLMBackend
    from grpo_fast.testing import tiny_vllm_engine

    tok, model, prompts, params = _work()
    engine = tiny_vllm_engine(model, tok, tmp_path)  # the tiny preset's rollout.vllm_kwargs
    backend = VLLMBackend(engine, tok)
    backend.update_weights(model)  # as the loop does before every rollout
    _bench(benchmark, backend, prompts, params, "vllm")
    benchmark.extra_info["versions"]["vllm"] = vllm.__version__


# LoRA (issue 21): the same work on a rank-16 adapter (configs/lora.yaml) over the tiny model.
# hf: generate on the peft model with the adapter unmerged (what the loop does) against a merged
# copy (merge_and_unload: no adapter branch per linear). vllm: decoding with the adapter as a LoRA
# request against the adapter merged into full weights; and the time of one push per sync mode.


def _lora_work():
    """The tiny work on a peft model: rank 16, alpha 32, lora_B random (a trained adapter)."""
    from grpo_fast.config import load_config
    from grpo_fast.policy.model import load_policy

    tok, _, prompts, params = _work()
    cfg = load_config("tiny", ["configs/lora.yaml"], check_device=False)
    torch.manual_seed(0)
    model = load_policy(cfg, tok, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return tok, model, prompts, params


@pytest.mark.benchmark(group="rollout-lora-cpu")
@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_rollout_hf_lora_cpu(benchmark, mode):
    import copy

    tok, model, prompts, params = _lora_work()
    if mode == "merged":
        model = copy.deepcopy(model).merge_and_unload()
    _bench(
        benchmark, HFBackend(model, tok, generation_batch_size=PROMPTS * GROUP), prompts, params, f"hf {mode}"
    )


def _plain_base(model):
    """The peft model's base as a plain transformers model (the adapter's wrappers taken off)."""
    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    plain = AutoModelForCausalLM.from_config(base.config)
    state = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
    plain.load_state_dict(state, strict=False)
    plain.tie_weights()
    return plain


def _lora_engine(tok, model, folder, lora_rank: int):
    from grpo_fast.config import load_config
    from grpo_fast.rollout.vllm import VLLMEngine

    _plain_base(model).save_pretrained(folder)
    tok.save_pretrained(folder)
    return VLLMEngine(
        str(folder), gpu_memory_utilization=0.3, max_model_len=32, seed=0, dtype="float32",
        extra_args=dict(load_config("tiny", check_device=False).rollout.vllm_kwargs), lora_rank=lora_rank,
    )  # fmt: skip


@pytest.mark.vllm
@pytest.mark.benchmark(group="rollout-lora-cpu")
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_rollout_vllm_lora_cpu(benchmark, tmp_path, mode):
    import vllm

    from grpo_fast.rollout.vllm import VLLMBackend

    tok, model, prompts, params = _lora_work()
    engine = _lora_engine(tok, model, tmp_path, lora_rank=16 if mode == "adapter" else 0)
    backend = VLLMBackend(engine, tok, sleep_level=0, lora_sync=mode)
    backend.update_weights(model)
    _bench(benchmark, backend, prompts, params, f"vllm {mode}")
    benchmark.extra_info["versions"]["vllm"] = vllm.__version__


@pytest.mark.vllm
@pytest.mark.benchmark(group="vllm-push-cpu")
@pytest.mark.parametrize("mode", ["full", "adapter", "merged"])
def test_vllm_push_cpu(benchmark, tmp_path, mode):
    """One weight push: the whole model (full fine-tuning), the adapter alone (a peft folder in
    /dev/shm and a new LoRA request), or the adapter merged into full weights."""
    import vllm

    from grpo_fast.rollout.vllm import VLLMBackend

    tok, model, _, _ = _lora_work()
    engine = _lora_engine(tok, model, tmp_path, lora_rank=16 if mode == "adapter" else 0)
    pushed = _plain_base(model) if mode == "full" else model
    backend = VLLMBackend(engine, tok, sleep_level=0, lora_sync=None if mode == "full" else mode)
    backend.update_weights(pushed)  # warm-up: the first adapter load compiles nothing, but allocates
    step = iter(range(1, 10**6))
    benchmark.pedantic(lambda: backend.update_weights(pushed, step=next(step)), rounds=ROUNDS)
    benchmark.extra_info.update(
        impl=f"push {mode}",
        case="tiny model + rank-16 adapter (configs/lora.yaml), fp32",
        load_average_1m=os.getloadavg()[0],
        versions={"torch": torch.__version__, "vllm": vllm.__version__},
    )


# Weight sync by placement (issue 32): one update_weights (the whole model, no probe) into the
# colocated engine (LLM.apply_model, in-process), an engine in its own process (AsyncLLM: pause keep,
# safetensors chunks in /dev/shm, vLLM's weight-transfer calls, resume) and a server (the same
# over HTTP), on the tiny preset's model and on the wider random Qwen2 of the peer cases
# (bench/peers/workloads.py: D 512, 6 layers, V 32,768, tied; ≈ 34 M parameters), fp32.
# One engine start per case: run each case in its own process, alternating (docs/rollout.md).


def _sync_model(which: str, folder):
    """(trainer model, tokenizer) of ``which``, saved to ``folder`` for the engine to start from."""
    if which == "tiny":
        tok = tiny.build_tokenizer()
        model = tiny.build_model(tok, seed=0)
    else:
        from bench.peers.workloads import wide_model, wide_tokenizer

        tok = wide_tokenizer()
        model = wide_model(tok, seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.eval(), tok


def _sync_engine(placement: str, folder, tmp_path):
    from grpo_fast.config import load_config
    from grpo_fast.rollout.vllm import VLLMEngine
    from grpo_fast.rollout.vllm.deadline import Timeouts
    from grpo_fast.rollout.vllm.transfer.transport import free_port

    common = dict(max_model_len=32, seed=0, dtype="float32")
    extra = dict(load_config("tiny", check_device=False).rollout.vllm_kwargs)
    timeouts = Timeouts(start=1800, request=600, sync=600)
    if placement == "colocated":
        return VLLMEngine(str(folder), gpu_memory_utilization=0.3, extra_args=extra, **common)
    if placement == "process":
        from grpo_fast.rollout.vllm.placement.process import ProcessEngine

        return ProcessEngine(str(folder), timeouts=timeouts, extra_args=extra, **common)
    from grpo_fast.rollout.vllm.placement.server import ServerEngine, server_command, start_server

    port = free_port()
    proc = start_server(
        server_command(str(folder), port, extra_args=extra, cpu=True, **common),
        port,
        tmp_path / "server.log",
        timeouts,
    )
    return ServerEngine(proc.url, timeouts=timeouts, dtype="float32", process=proc)


@pytest.mark.vllm
@pytest.mark.benchmark(group="vllm-sync-cpu")
@pytest.mark.parametrize("model_name", ["tiny", "wide"])
@pytest.mark.parametrize("placement", ["colocated", "process", "server"])
def test_vllm_weight_sync_cpu(benchmark, tmp_path, placement, model_name):
    import vllm

    from grpo_fast.rollout.vllm import VLLMBackend

    model, tok = _sync_model(model_name, tmp_path / "model")
    engine = _sync_engine(placement, tmp_path / "model", tmp_path)
    backend = VLLMBackend(engine, tok, sleep_level=0)
    try:
        backend.update_weights(model, step=0)  # warm-up
        step = iter(range(1, 10**6))
        benchmark.pedantic(lambda: backend.update_weights(model, step=next(step)), rounds=ROUNDS)
    finally:
        backend.close()
    params = sum(p.numel() for p in model.parameters())
    transport = getattr(engine, "transport", None)
    benchmark.extra_info.update(
        impl=f"sync {placement}",
        case=f"{model_name} model ({params / 1e6:.2f} M parameters, tied), fp32",
        bytes_per_sync=getattr(transport, "bytes_sent", None),
        load_average_1m=os.getloadavg()[0],
        cpu_count=os.cpu_count(),
        versions={"torch": torch.__version__, "vllm": vllm.__version__},
        command=(
            "for p in colocated process server; do .venv-vllm/bin/python -m pytest bench/test_bench_rollout.py "
            '-p no:cacheprovider -k "weight_sync and $p" --benchmark-json bench/results/vllm-sync-$p.json; done'
        ),
    )


class _ReadingControl:
    """An engine's side of an shm sync, as far as the files go: each ``update_weights`` reads every
    tensor of its file (what ``ShmWeightTransferEngine`` does before copying into its layers)."""

    def pause(self, deadline): ...
    def resume(self, deadline): ...
    def start_weight_update(self, deadline): ...
    def finish_weight_update(self, version, deadline): ...

    def update_weights(self, info, deadline):
        from safetensors import safe_open

        with safe_open(info["path"], framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                f.get_tensor(name)


@pytest.mark.benchmark(group="fleet-shm-cpu")
@pytest.mark.parametrize("mode", ["per engine", "once"])
@pytest.mark.parametrize("engines", [2, 4])
def test_fleet_shm_write_once_cpu(benchmark, engines, mode):
    """A fleet's weight sync through ``/dev/shm`` with ``engines`` engines loading at once (threads, as
    ``Fleet.load_weights``), before and after ``StagedShm``: each engine's transport writing its own
    chunks (``per engine``), against the version written once and every engine reading those files
    (``once``). 24 fp32 host tensors of 4,096 × 1,536 (604 M bytes; 302 MB in bf16, the engines'
    dtype), 256-MiB files; the engines' reads are real, their copies into vLLM's layers are not
    here (the same in both). Each timed round follows an untimed round of the other mode, so the two
    alternate in both rows."""
    import threading

    from grpo_fast.rollout.vllm.deadline import Deadline
    from grpo_fast.rollout.vllm.transfer.transport import ShmTransport, StagedShm, sync

    tensors = {f"model.layers.{i}.w": torch.randn(4096, 1536) for i in range(24)}

    def fleet_sync(once: bool) -> None:
        staged = StagedShm(tensors.items(), torch.bfloat16) if once else None

        def one(t: ShmTransport) -> None:
            what = staged if once else tensors.items()
            sync(_ReadingControl(), t, what, 1, Deadline(600, "sync", "rollout.sync_timeout"))

        threads = [threading.Thread(target=one, args=(ShmTransport(torch.bfloat16),)) for _ in range(engines)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if staged is not None:
            staged.close()

    once = mode == "once"
    fleet_sync(once)  # warm-up
    benchmark.pedantic(fleet_sync, args=(once,), setup=lambda: fleet_sync(not once), rounds=5)
    benchmark.extra_info.update(
        impl=mode,
        case=f"{engines} engines, 302 MB of bf16 weights a version (24 × 4,096 × 1,536), 256-MiB files",
        load_average_1m=os.getloadavg()[0],
        cpu_count=os.cpu_count(),
        versions={"torch": torch.__version__},
        command=(
            "python -m pytest bench/test_bench_rollout.py -k fleet_shm -p no:cacheprovider "
            "--benchmark-json bench/results/fleet-shm-cpu-$(date -u +%F).json"
        ),
    )
