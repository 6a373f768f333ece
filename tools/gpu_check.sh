#!/usr/bin/env bash
# One GPU check in under 10 minutes: environment, copy bandwidth, the `gpu` tests, the GPU benchmarks
# (the fused op's chunk_size axis, the rtx4090 step capped at 24 GB), two training steps with vLLM.
#
#   tools/gpu_check.sh OUTDIR                        # on a CUDA machine, from anywhere
#   GPU_CHECK_DRY_RUN=1 tools/gpu_check.sh OUTDIR    # print the commands, run nothing but the preflight
#   GPU_CHECK_BENCH_MARK='not gpu and not slow' tools/gpu_check.sh OUTDIR   # the CPU benchmarks instead
#                                                    # (exercises every part of the script on a CPU)
#
# Needs python with torch, triton and pytest; runs from the source tree (PYTHONPATH=., no install,
# no network: HF_HUB_OFFLINE=1). A module whose import fails for a missing package (transformers,
# pytest-benchmark, hypothesis, ...) is left out and listed as skipped: the kernel tests and kernel
# benchmarks need only torch, triton, pytest and pytest-benchmark. Wheels in ROOT/.whl (e.g.
# bitsandbytes for the rtx4090 step's 8-bit AdamW, vllm and its dependencies for the vLLM step, on a
# machine without network) are installed first into a private --target folder on PYTHONPATH.
#
# Parts, each under `timeout` (SIGINT first, so pytest still writes what it measured) with a cap
# shrunk to the time left of GPU_CHECK_BUDGET_S (default 570 s = 9.5 min):
#   wheels 60 s (only with ROOT/.whl), preflight 60 s, nvidia-smi 20 s, copy bandwidth 60 s,
#   `python -m pytest -m gpu tests/` 120 s, the kernel tests' triton cases on the GPU 90 s, then
#   `python -m pytest -m gpu bench/<file>` per benchmark file (80-110 s each; the fused op's file
#   has the chunk_size axis, 384 to 4,096 rows at N = 8,192, V = 151,936 bf16; the train-step file
#   has the rtx4090 preset on a card capped at 24 GB, skipped without bitsandbytes), the vLLM step
#   (2 steps of the tiny preset's loop with rollout.backend=vllm, rollout.sleep_level=1, on its
#   random Qwen2 saved offline; skipped without vllm) 120 s, the same with configs/qlora.yaml (NF4
#   base, adapter sync to vLLM) 90 s, the tool-use step (2 steps of --preset tiny_tools: multi-turn
#   rollouts with the calculator on vLLM) 90 s, the FSDP step (2 steps of the tiny preset's loop under torchrun
#   with configs/fsdp.yaml on 2 GPUs, a sharded checkpoint at step 2; skipped on fewer GPUs) 90 s,
#   the vLLM NCCL step (2 steps with rollout.placement=process on GPU 1 and weights over NCCL from
#   GPU 0; skipped on fewer GPUs or without vllm) 90 s,
#   the sequence-parallel step (2 steps of the tiny preset's loop under torchrun with
#   train.sequence_parallel=2 on 2 GPUs: Ulysses all-to-alls and the sp group's batch over nccl;
#   skipped on fewer GPUs) 90 s, report 30 s. The fused op's file has the frozen_head axis too.
#   Expected on an H200: ≈ 8-9 min; the budget keeps the whole script under 10 min.
#
# OUTDIR gets 11 files: env.json (versions, GPU, copy bandwidth, every part's command, status and
# time), nvidia-smi.txt, check.log (preflight, bandwidth, report), tests.log, bench.log, vllm.log
# (the vLLM step's training log and metrics), fsdp.log (the FSDP step's), sp.log (the
# sequence-parallel step's), bench.json
# (pytest-benchmark JSON of all benchmark files, with each case's command), BENCHMARKS.md
# (tools/bench_report.py) and summary.md (printed at the end). A failing part is recorded and the
# script goes on; it exits 0.

set -u -o pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: tools/gpu_check.sh OUTDIR   (GPU_CHECK_DRY_RUN=1 to print the commands only)" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
cd "$ROOT" || exit 2
DRY="${GPU_CHECK_DRY_RUN:-0}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"
BENCH_MARK="${GPU_CHECK_BENCH_MARK:-gpu}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
START_S=$(date +%s)
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PARTS="$TMP/parts.tsv"  # name, status, seconds, command: one line per part
: >"$PARTS"

# run_part NAME CAP_S LOG COMMAND...: run COMMAND under timeout (stdout+stderr appended to LOG) and
# record its status; the cap shrinks to the budget left, minus 30 s kept for the report. A dry run
# prints the command and runs only the preflight (it decides which modules the commands leave out).
run_part() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((BUDGET_S - ($(date +%s) - START_S) - 30))
    local limit=$((cap < left ? cap : left))
    local cmd
    cmd=$(printf '%q ' "$@")
    cmd=${cmd% }
    if ((limit < 10)); then
        printf '%s\tskipped: no time left of the %s s budget\t0\t%s\n' "$name" "$BUDGET_S" "$cmd" >>"$PARTS"
        return
    fi
    echo "+ [$name, ${limit} s] $cmd"
    if [[ "$DRY" == 1 && "$name" != preflight ]]; then
        printf '%s\tdry run\t0\t%s\n' "$name" "$cmd" >>"$PARTS"
        return
    fi
    local t0 rc status
    t0=$(date +%s)
    echo "+ $cmd" >>"$log"
    timeout -s INT -k 15 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        5) status="ok (no tests selected)" ;;
        124 | 137) status="timed out after ${limit} s (pytest keeps what it measured)" ;;
        *) status="failed (exit code $rc, see $(basename "$log"))" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" "$cmd" >>"$PARTS"
}

# ---- wheels carried in ROOT/.whl (no network on the GPU machine): into a private folder
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    run_part wheels 60 "$OUT/check.log" "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$TMP/site" "$ROOT"/.whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$TMP/site"
fi

# ---- preflight: versions, CUDA, and which test/benchmark modules import here
run_part preflight 60 "$OUT/check.log" "$PY" - "$TMP/preflight.json" <<'EOF'
import importlib, importlib.util, json, os, sys
from pathlib import Path

def version(name):
    try:
        return importlib.import_module(name).__version__
    except Exception as exc:  # missing, or broken at import: say which
        return None if isinstance(exc, ImportError) else f"broken: {exc!r}"[:200]

info = {"versions": {m: version(m) for m in ("torch", "triton", "pytest", "pytest_benchmark", "transformers",
                                             "bitsandbytes", "hypothesis", "liger_kernel", "vllm")}}
torch = importlib.import_module("torch") if info["versions"]["torch"] else None
info["versions"]["cuda"] = torch.version.cuda if torch else None
info["cuda_available"] = bool(torch and torch.cuda.is_available())
info["gpu_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
if info["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    info["device"] = f"{p.name}, {p.total_memory / 1e9:.0f} GB, {p.multi_processor_count} SMs"
info["cpu_count"] = os.cpu_count()
# A module whose import raises ImportError (a missing package) is skipped with the reason; any other
# error stays in the run, where pytest reports it.
info["unimportable"] = {}
for path in sorted(Path("tests").glob("test_*.py")) + sorted(Path("bench").glob("test_bench_*.py")):
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_preflight_{path.parent.name}_{path.stem}", path)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except ImportError as exc:
        info["unimportable"][str(path)] = f"{type(exc).__name__}: {exc}"
    except BaseException:
        pass
    finally:
        sys.path.remove(str(path.parent))
Path(sys.argv[1]).write_text(json.dumps(info, indent=2))
EOF
if [[ ! -s "$TMP/preflight.json" ]]; then  # dry run, or it failed (check.log says why)
    echo '{"versions": {}, "cuda_available": false, "unimportable": {}}' >"$TMP/preflight.json"
fi
mapfile -t SKIP < <("$PY" -c 'import json,sys; [print(p) for p in json.load(open(sys.argv[1]))["unimportable"]]' "$TMP/preflight.json")
IGNORE=()
for path in ${SKIP[@]+"${SKIP[@]}"}; do [[ $path == tests/* ]] && IGNORE+=("--ignore=$path"); done
read -r has_bench_plugin has_cuda < <("$PY" -c 'import json, sys; p = json.load(open(sys.argv[1]))
print(int(bool(p["versions"].get("pytest_benchmark"))), int(p["cuda_available"]))' "$TMP/preflight.json")

# ---- environment: nvidia-smi, then versions and a device-to-device copy bandwidth
if command -v nvidia-smi >/dev/null; then
    run_part nvidia-smi 20 "$OUT/nvidia-smi.txt" bash -c \
        "nvidia-smi && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,power.limit --format=csv"
else
    printf 'nvidia-smi\tskipped: nvidia-smi not found\t0\tnvidia-smi\n' >>"$PARTS"
fi
if [[ "$has_cuda" == 1 || "$DRY" == 1 ]]; then
    run_part copy-bandwidth 60 "$OUT/check.log" "$PY" - "$TMP/bandwidth.json" <<'EOF'
import json, sys

from grpo_fast.obs.memory import copy_bandwidth_gbps  # torch only: runs without transformers

gbps = copy_bandwidth_gbps("cuda")
json.dump({"copy_gb_per_s": gbps}, open(sys.argv[1], "w"))
print(f"copy bandwidth: {gbps:,.0f} GB/s")
EOF
else
    printf 'copy-bandwidth\tskipped: no CUDA device\t0\t-\n' >>"$PARTS"
fi

# ---- the gpu-marked tests, then every triton case of the kernel tests on the real GPU (on a CPU
# they run under the interpreter; with CUDA, grpo_fast.testing.backend_device sends them to it)
run_part tests 120 "$OUT/tests.log" "$PY" -m pytest -m gpu tests/ -q -p no:cacheprovider -rfEs \
    ${IGNORE[@]+"${IGNORE[@]}"}
run_part kernel-tests 90 "$OUT/tests.log" "$PY" -m pytest -m "not gpu and not slow" -k triton \
    tests/test_token_logprobs.py tests/test_grpo_loss.py tests/test_fused_linear_grpo_loss.py \
    tests/test_truncated_logprobs.py -q -p no:cacheprovider -rfEs ${IGNORE[@]+"${IGNORE[@]}"}

# ---- the GPU benchmarks, one pytest run per file (a slow file cannot take the others' results with it)
if [[ "$has_bench_plugin" != 1 ]]; then
    printf 'bench\tskipped: pytest-benchmark is not installed\t0\t-\n' >>"$PARTS"
else
    # file:cap_s, most valuable first (each op file compiles eager with torch.compile for 3 shapes)
    for entry in bench/test_bench_token_logprobs.py:80 bench/test_bench_grpo_loss.py:90 \
        bench/test_bench_fused_linear_grpo_loss.py:110 bench/test_bench_train_step.py:90; do
        file=${entry%:*}
        name="bench:$(basename "$file" .py)"
        if [[ ! -f "$file" ]]; then
            printf '%s\tskipped: %s not found\t0\t-\n' "$name" "$file" >>"$PARTS"
        elif [[ " ${SKIP[*]-} " == *" $file "* ]]; then
            printf '%s\tskipped: cannot import it here\t0\t-\n' "$name" >>"$PARTS"
        else
            run_part "$name" "${entry#*:}" "$OUT/bench.log" "$PY" -m pytest -m "$BENCH_MARK" "$file" -q \
                -p no:cacheprovider --benchmark-json="$TMP/$(basename "$file" .py).json"
        fi
    done
fi

# ---- vLLM: two steps of the training loop with rollout.backend=vllm and sleep mode level 1, on the
# tiny preset's random Qwen2 (built in-process, saved to output_dir/rollout_init for vLLM, no
# download); no SFT warm start, no evaluation: only the loop's rollout -> train -> weight push.
read -r has_vllm < <("$PY" -c 'import json, sys; print(int(bool(json.load(open(sys.argv[1]))["versions"].get("vllm"))))' \
    "$TMP/preflight.json")
if [[ "$has_cuda" != 1 && "$DRY" != 1 ]]; then
    printf 'vllm-steps\tskipped: no CUDA device\t0\t-\n' >>"$PARTS"
elif [[ "$has_vllm" != 1 && "$DRY" != 1 ]]; then
    printf 'vllm-steps\tskipped: vllm is not installed (pip install -e ".[gpu]", or wheels in .whl)\t0\t-\n' >>"$PARTS"
else
    run_part vllm-steps 120 "$OUT/vllm.log" "$PY" -m grpo_fast.train --preset tiny device=cuda \
        rollout.backend=vllm rollout.sleep_level=1 rollout.gpu_memory_utilization=0.3 steps=2 \
        sft.steps=0 eval_every=0 checkpoint_every=0 "output_dir=$TMP/vllm-run"
    # QLoRA on CUDA: the NF4 base under bf16 autocast, vLLM served the dequantized base once and the
    # adapter as a LoRA request after every step (rollout.lora_sync=adapter), the weight-sync check on
    run_part qlora-vllm-steps 90 "$OUT/vllm.log" "$PY" -m grpo_fast.train --preset tiny device=cuda \
        --config configs/qlora.yaml rollout.backend=vllm rollout.sleep_level=1 \
        rollout.gpu_memory_utilization=0.3 steps=2 sft.steps=0 eval_every=0 checkpoint_every=0 \
        "output_dir=$TMP/qlora-vllm-run"
    # Tool use: two steps of the tiny_tools preset (multi-turn: generate to the calculator's stop
    # string, run the stopped rows' calls, continue from the token prompts with the result inserted)
    run_part tools-vllm-steps 90 "$OUT/vllm.log" "$PY" -m grpo_fast.train --preset tiny_tools device=cuda \
        rollout.backend=vllm rollout.sleep_level=1 rollout.gpu_memory_utilization=0.3 steps=2 \
        sft.steps=0 eval_every=0 checkpoint_every=0 "output_dir=$TMP/tools-vllm-run"
fi

# ---- FSDP2: two steps of the tiny preset's loop under torchrun on 2 GPUs (nccl), configs/fsdp.yaml:
# sharded training, the hf rollout on the gathered model, a sharded checkpoint, the final model
read -r n_gpus < <("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("gpu_count", 0))' \
    "$TMP/preflight.json")
if [[ "${n_gpus:-0}" -lt 2 && "$DRY" != 1 ]]; then
    echo "fsdp-steps: skipped, it needs 2 GPUs and this machine has ${n_gpus:-0}"
    printf 'fsdp-steps\tskipped: needs 2 GPUs, found %s\t0\t-\n' "${n_gpus:-0}" >>"$PARTS"
else
    run_part fsdp-steps 90 "$OUT/fsdp.log" "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m grpo_fast.train --preset tiny device=cuda --config configs/fsdp.yaml steps=2 sft.steps=0 \
        eval_every=0 checkpoint_every=2 "output_dir=$TMP/fsdp-run"
fi

# ---- vLLM apart from the trainer, weights over NCCL (never run on a CPU): two steps of the tiny
# preset with rollout.placement=process (AsyncLLM on GPU 1, the trainer on GPU 0) and
# rollout.weight_transfer=nccl (vLLM's NCCLTrainerWeightTransferEngine), the weight-sync probe on
if [[ "${n_gpus:-0}" -lt 2 || "$has_vllm" != 1 ]] && [[ "$DRY" != 1 ]]; then
    printf 'vllm-nccl-steps\tskipped: needs 2 GPUs and vllm (found %s GPUs)\t0\t-\n' "${n_gpus:-0}" >>"$PARTS"
else
    run_part vllm-nccl-steps 90 "$OUT/vllm.log" "$PY" -m grpo_fast.train --preset tiny device=cuda \
        rollout.backend=vllm rollout.placement=process rollout.weight_transfer=nccl "rollout.engine_devices=[1]" \
        rollout.gpu_memory_utilization=0.3 steps=2 sft.steps=0 eval_every=0 checkpoint_every=0 \
        "output_dir=$TMP/vllm-nccl-run"
fi

# ---- sequence parallelism: two steps of the tiny preset's loop under torchrun on 2 GPUs (nccl) with
# train.sequence_parallel=2: each rank generates its prompts, the pair shares its batch and trains it
# with half of every sequence's tokens each (Ulysses all-to-all over nccl); metrics in sp.log
if [[ "${n_gpus:-0}" -lt 2 && "$DRY" != 1 ]]; then
    echo "sp-steps: skipped, it needs 2 GPUs and this machine has ${n_gpus:-0}"
    printf 'sp-steps\tskipped: needs 2 GPUs, found %s\t0\t-\n' "${n_gpus:-0}" >>"$PARTS"
else
    run_part sp-steps 90 "$OUT/sp.log" "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m grpo_fast.train --preset tiny device=cuda train.sequence_parallel=2 steps=2 sft.steps=0 \
        eval_every=0 checkpoint_every=0 "output_dir=$TMP/sp-run"
    [[ "$DRY" == 1 ]] || cat "$TMP/sp-run/metrics.jsonl" >>"$OUT/sp.log" 2>/dev/null
fi

# ---- bench.json (all files, each case with its command), BENCHMARKS.md, env.json, summary.md
if [[ "$DRY" == 1 ]]; then
    echo "+ [report] merge $TMP/test_bench_*.json into $OUT/bench.json; $PY tools/bench_report.py $OUT/bench.json --out $OUT/BENCHMARKS.md"
fi
"$PY" - "$OUT" "$TMP" "$BUDGET_S" "$START_S" "$DRY" "$ROOT" <<'EOF'
import json, re, subprocess, sys, time
from pathlib import Path

out, tmp, budget, start, dry, root = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
pre = json.loads((tmp / "preflight.json").read_text())
bw_file = tmp / "bandwidth.json"
copy_gbps = json.loads(bw_file.read_text())["copy_gb_per_s"] if bw_file.exists() else None
parts = []
for line in (tmp / "parts.tsv").read_text().splitlines():
    name, status, seconds, command = line.split("\t", 3)
    parts.append({"name": name, "status": status, "seconds": int(seconds), "command": command})
skipped = [f"{path}: {why}" for path, why in pre["unimportable"].items()]
env = {
    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "device": pre.get("device"),
    "versions": pre["versions"],
    "cpu_count": pre.get("cpu_count"),
    "copy_gb_per_s": copy_gbps,
    "parts": parts,
    "skipped_modules": skipped,
    "environment": f"cd {root}; PYTHONPATH={root} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1",
}

merged = None
commands = {p["name"].removeprefix("bench:"): p["command"] for p in parts if p["name"].startswith("bench:")}
for part in sorted(tmp.glob("test_bench_*.json")):
    data = json.loads(part.read_text())
    for bench in data["benchmarks"]:
        bench.setdefault("extra_info", {}).setdefault("command", commands.get(part.stem))
    if merged is None:
        merged = data
    else:
        merged["benchmarks"] += data["benchmarks"]
if merged is not None:
    merged["grpo_fast_env"] = {
        "device": env["device"],
        "versions": {k: env["versions"].get(k) for k in ("torch", "triton", "cuda", "transformers", "bitsandbytes")},
        "cpu_count": env["cpu_count"],
        "copy_gb_per_s": copy_gbps,
        "commands": sorted(set(commands.values())),
        "notes": [f"Not run (import failed): {s}" for s in skipped if s.startswith("bench/")]
        + [f"{p['name']}: {p['status']}" for p in parts if p["name"].startswith("bench:") and p["status"] != "ok"],
    }
    (out / "bench.json").write_text(json.dumps(merged, indent=2))
    t0 = time.time()
    with open(out / "check.log", "a") as log:
        rc = subprocess.run(
            [sys.executable, "tools/bench_report.py", str(out / "bench.json"), "--out", str(out / "BENCHMARKS.md")],
            stdout=log, stderr=log,
        ).returncode
    parts.append({"name": "report", "status": "ok" if rc == 0 else f"failed (exit code {rc}, see check.log)",
                  "seconds": round(time.time() - t0), "command": "python tools/bench_report.py bench.json"})
(out / "env.json").write_text(json.dumps(env, indent=2))

tests = "not run"
log = out / "tests.log"
if log.exists():  # pytest's last line: "4 passed, 2 skipped, 457 deselected in 3.21s"
    counts = [ln for ln in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|error|skipped|deselected)", ln)]
    tests = counts[-1].strip("= ") if counts else "no result line in tests.log"
n_bench = len(merged["benchmarks"]) if merged else 0
v = env["versions"]
lines = [
    f"# GPU check {'(dry run) ' if dry else ''}— {env['date']}",
    "",
    f"- device: {env['device'] or 'no CUDA device'}; torch {v.get('torch')}, triton {v.get('triton')}, CUDA {v.get('cuda')}, "
    f"transformers {v.get('transformers') or 'missing'}, bitsandbytes {v.get('bitsandbytes') or 'missing'}",
    f"- copy bandwidth: {f'{copy_gbps:,.0f} GB/s' if copy_gbps else 'not measured'}",
    f"- tests (-m gpu): {tests}",
    f"- benchmarks: {n_bench} cases in bench.json" + (", tables in BENCHMARKS.md" if n_bench else ""),
    f"- total: {round(time.time() - start)} s of a {budget} s budget; commands run with: {env['environment']}",
    "",
    "| part | status | s | command |",
    "|---|---|---:|---|",
    *(f"| {p['name']} | {p['status']} | {p['seconds']} | `{p['command']}` |" for p in parts),
]
if skipped:
    lines += ["", "Skipped modules (import failed here):", "", *(f"- {s}" for s in skipped)]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
exit 0
