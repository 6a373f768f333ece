"""What this machine can run: ``python -m grpo_fast.doctor`` (or ``grpo-fast doctor``).

Prints the versions of the libraries the engine uses, the cores, load and CPU threads (intra-op
threads, OpenMP wait: ``grpo_fast.threads``), CUDA and each GPU's memory, whether the
code sandbox of tool calls runs here (bubblewrap), which presets fit here (by the memory planner's formulas, ``grpo_fast.tools.plan``), and whether the Triton kernels
compile and run here — on a GPU natively, on a CPU under the interpreter
(``TRITON_INTERPRET=1``), in a subprocess on a tiny case of ``csrc_triton`` checked against the
eager reference. Every problem comes with the command that fixes it.

Exit code 0 unless something the tiny preset needs is broken (a missing or too-old required
package, or too little memory for it); then 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from packaging.requirements import Requirement

from grpo_fast.errors import UserError, cli_errors

GB = 1e9
LIBRARIES = ("torch", "triton", "transformers", "vllm", "bitsandbytes", "flash-attn")
TRITON_TIMEOUT_S = 300

# A tiny case of the token-logprobs kernel against the eager reference, run in a fresh
# interpreter (TRITON_INTERPRET must be set before triton is first imported).
_TRITON_CHECK = """
import sys, torch
from csrc_triton.token_logprobs import token_logprobs_fwd
from grpo_fast.algo.core import eager_token_logprobs_and_entropy
device = sys.argv[1]
g = torch.Generator().manual_seed(0)
logits = (torch.randn(5, 37, generator=g) * 3).to(device)
labels = torch.randint(0, 37, (5,), generator=g).to(device)
logp, ent, _, _ = token_logprobs_fwd(logits, labels, 1.0 / 0.7)
ref_logp, ref_ent = eager_token_logprobs_and_entropy(logits.double().cpu(), labels.cpu(), 0.7)
err = max((logp.cpu().double() - ref_logp).abs().max().item(), (ent.cpu().double() - ref_ent).abs().max().item())
print(f"max abs error {err:.2e} against the float64 reference")
sys.exit(0 if err < 1e-4 else 3)
"""


KEY_WIDTH = 18  # the label column: "preset tiny_tools" (17) and a space


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (what is wrong, the fix)
    tiny_broken: bool = False

    def row(self, key: str, value: str) -> None:
        self.lines.append(f"{key:<{KEY_WIDTH}} {value}")

    def problem(self, what: str, fix: str, breaks_tiny: bool = False) -> None:
        self.problems.append((what, fix))
        self.tiny_broken |= breaks_tiny


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_libraries(rep: Report) -> None:
    """Versions of the main libraries, and every required dependency present and recent enough."""
    rep.row("python", sys.version.split()[0])
    for lib in LIBRARIES:
        rep.row(lib, _version(lib) or "not installed")
    try:
        requires = metadata.requires("grpo_fast") or []
    except metadata.PackageNotFoundError:
        rep.problem("grpo_fast is not installed as a package", 'pip install -e ".[dev]"')
        return
    for spec in requires:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (gpu, wandb, dev) or another platform's dependency
        have = _version(req.name)
        if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
            found = "not installed" if have is None else f"{have} installed"
            rep.problem(
                f"required {req.name}{req.specifier} ({found})",
                f'pip install "{req.name}{req.specifier}"',
                True,
            )


def check_cuda(rep: Report) -> list[tuple[str, float]]:
    """CUDA and each GPU's memory; returns ``[(name, total bytes)]``."""
    import torch

    gpus = []
    smi = shutil.which("nvidia-smi")
    if torch.cuda.is_available():
        rep.row("cuda", f"{torch.version.cuda} ({torch.cuda.device_count()} device(s))")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append((props.name, float(props.total_memory)))
            rep.row(f"gpu {i}", f"{props.name}, {props.total_memory / GB:.1f} GB")
        from grpo_fast.config import PRESETS, load_config
        from grpo_fast.rollout import backend

        gpu_backends = {load_config(n, check_device=False).rollout.backend for n in PRESETS}
        for name in sorted(gpu_backends):
            if backend(name).missing() is not None:
                rep.problem(
                    f"rollout.backend={name} cannot run here: the GPU presets roll out with it",
                    'pip install -e ".[dev,gpu]"',
                )
        if _version("flash-attn") is None:
            rep.problem(
                "flash-attn is not installed (the model then runs SDPA where it would use it: with "
                "train.share_prompts=false, whose default auto runs SDPA anyway)",
                "pip install flash-attn --no-build-isolation",
            )
    else:
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "the CPU build"
        rep.row("cuda", f"not available (torch is {built})")
        if smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0:
            rep.problem(
                "this machine has an NVIDIA GPU but torch cannot use it",
                f"pip install --force-reinstall torch=={torch.__version__.split('+')[0]} (PyPI's Linux wheel is the CUDA build)",
            )
    return gpus


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_presets(rep: Report, gpus: list[tuple[str, float]]) -> None:
    """Each preset against this machine: its device, and its peak by the planner's formulas
    (against the first GPU's memory, or the host's for a CPU run)."""
    from grpo_fast.config import AUTO, PRESETS, load_config
    from grpo_fast.rollout import backend
    from grpo_fast.tools import plan

    for name in PRESETS:
        cfg = load_config(name, check_device=False)
        device = cfg.device if cfg.device != AUTO else ("cuda" if gpus else "cpu")
        if device.startswith("cuda") and not gpus:
            rep.row(f"preset {name}", "no: needs a CUDA GPU")
            continue
        spec = backend(cfg.rollout.backend)
        missing = spec.missing()
        if missing is not None:
            rep.row(f"preset {name}", f"no: {missing}")
            continue
        on_gpu = device.startswith("cuda")
        capacity = gpus[0][1] if on_gpu else host_memory_bytes()
        where = f"{gpus[0][0]} {capacity / GB:.0f} GB" if on_gpu else f"CPU, {capacity / GB:.0f} GB RAM"
        try:
            mp = plan.plan_memory(cfg, plan.arch_for(cfg), capacity)
        except UserError as exc:
            rep.row(f"preset {name}", f"no ({where}): {exc}")
            continue
        # an engine with its own weights and KV cache (vllm) peaks in the rollout too
        peak = max(mp.train_peak, mp.rollout_peak) if spec.needs_weight_push else mp.train_peak
        fits = peak <= capacity
        rep.row(f"preset {name}", f"{'yes' if fits else 'no'}: planned peak {peak / GB:.1f} GB on {where}")
        if name == "tiny" and not fits:
            rep.problem(
                f"the tiny preset needs ~{peak / GB:.1f} GB and this machine has {capacity / GB:.1f} GB",
                "free memory, or lower rollout.batch_size",
                True,
            )


def check_triton(rep: Report, on_gpu: bool) -> None:
    """Run the Triton kernel on a tiny case in a subprocess: natively on a GPU, else under the
    interpreter (``TRITON_INTERPRET=1``)."""
    if _version("triton") is None:
        rep.row(
            "triton kernels", "not run: triton is not installed (loss.kernel_backend=torch_chunked works)"
        )
        rep.problem("triton is not installed", 'pip install "triton>=3.1"')
        return
    env = {**os.environ}
    if on_gpu:
        env.pop("TRITON_INTERPRET", None)
        how = "compiled for the GPU"
    else:
        env["TRITON_INTERPRET"] = "1"
        how = "under the interpreter (TRITON_INTERPRET=1, CPU)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            [sys.executable, "-c", _TRITON_CHECK, "cuda" if on_gpu else "cpu"],
            capture_output=True,
            text=True,
            timeout=TRITON_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        rep.row("triton kernels", f"no: the tiny case did not finish in {TRITON_TIMEOUT_S} s ({how})")
        rep.problem("the Triton check timed out", "python -m pytest tests/test_token_logprobs.py -x -q")
        return
    seconds = time.perf_counter() - t0
    if res.returncode == 0:
        rep.row("triton kernels", f"yes, {how}: {res.stdout.strip()} ({seconds:.1f} s)")
        return
    tail = (res.stderr.strip().splitlines() or res.stdout.strip().splitlines() or ["no output"])[-1]
    rep.row("triton kernels", f"no ({how}): {tail}")
    rep.problem(
        f"the Triton kernels do not run here ({tail}); loss.kernel_backend=torch_chunked avoids them",
        f'pip install --force-reinstall "triton=={_version("triton")}"',
    )


def check_backends(rep: Report) -> None:
    """Each rollout backend of the registry: whether it can run here, and what it can do."""
    from grpo_fast.rollout import backends

    for name, spec in backends().items():
        can = [c for c, on in (("weight push", spec.needs_weight_push), ("sampler log-probs", spec.sampler_logprobs),
                               ("sleep mode", spec.sleep_mode)) if on]  # fmt: skip
        what = f" ({', '.join(can)})" if can else ""
        missing = spec.missing()
        rep.row(f"backend {name}", f"yes{what}" if missing is None else f"no: {missing}")


def check_threads(rep: Report) -> None:
    """This machine's cores and load, torch's intra-op threads and OpenMP wait here, and what the
    tiny preset would use (``grpo_fast.threads``); a busy machine with spinning OpenMP a problem."""
    import torch

    from grpo_fast import threads

    cores, load = threads.usable_cores(), threads.load_average()
    loads = " ".join(f"{x:.2f}" for x in os.getloadavg()) if load is not None else "unknown"
    rep.row("cpu", f"{cores} usable cores, load average {loads} (1, 5, 15 min)")
    wait = threads.wait_policy_in_effect()
    tiny = threads.choose_threads("auto", "cpu", 128, cores, load)  # the tiny preset's model: hidden 128
    rep.row(
        "threads",
        f"torch {torch.get_num_threads()} intra-op here, OpenMP wait {wait}; the tiny preset: "
        f"{tiny.threads} to start ({tiny.why}; threads.intra_op)",
    )
    from grpo_fast.policy.model import cpu_computes_bf16

    native = cpu_computes_bf16()
    rep.row(
        "cpu precision",
        f"{native}: train.mixed_precision=auto is bf16 autocast on this CPU"
        if native
        else "no native bf16 dot products: train.mixed_precision=auto is fp32 on this CPU",
    )
    if load is not None and load >= cores and threads.spins_long(wait):
        rep.problem(
            f"this machine is busy (load {load:.1f} on {cores} cores) and OpenMP here spins between "
            f"parallel regions (wait {wait}): runs slow each other down many times over",
            f"unset OMP_WAIT_POLICY / GOMP_SPINCOUNT (the grpo-fast commands then spin {threads.SHORT_SPIN} "
            "times, ~2.6 ms), or threads.wait_policy=passive",
        )


def check_sandbox(rep: Report) -> None:
    """The code sandbox of the ``python`` tool environment: bubblewrap found, and one trivial
    call run in it (namespaces may be forbidden where bwrap is installed: some containers)."""
    from grpo_fast.sandbox import BWRAP_FIX, Limits, Sandbox, SandboxUnavailable, bwrap_status

    version, problem = bwrap_status()
    if problem is None:
        t0 = time.perf_counter()
        try:
            Sandbox(Limits(timeout_s=60.0), workers=1)  # runs print('ok') in it once
        except SandboxUnavailable as exc:
            problem = str(exc)
    if problem is None:
        seconds = time.perf_counter() - t0
        rep.row(
            "sandbox",
            f"yes: bubblewrap {version}, set-up and a trivial call {seconds:.2f} s (tool calls run isolated)",
        )
        return
    rep.row("sandbox", f"no: {problem}")
    fix = (
        BWRAP_FIX
        if version is None
        else "see docs/tools.md (the sandbox), or isolation=unsafe for trusted code"
    )
    rep.problem(f"tool calls (the python environment) cannot run: {problem}", fix)


def diagnose(run_triton: bool = True) -> Report:
    """Every check, in order; the ``Report`` holds the lines, the problems and the verdict."""
    rep = Report()
    check_libraries(rep)
    check_threads(rep)
    check_backends(rep)
    check_sandbox(rep)
    gpus = check_cuda(rep)
    check_presets(rep, gpus)
    if run_triton:
        check_triton(rep, on_gpu=bool(gpus))
    return rep


@cli_errors
def main(argv: list[str] | None = None, prog: str = "python -m grpo_fast.doctor") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="What this machine can run: versions, CUDA, presets that fit, Triton kernels.",
    )
    p.add_argument("--no-triton", action="store_true", help="skip the Triton kernel check (seconds on a CPU)")
    args = p.parse_args(argv)
    rep = diagnose(run_triton=not args.no_triton)
    print("\n".join(rep.lines))
    if rep.problems:
        print(f"\n{len(rep.problems)} problem(s):")
        for what, fix in rep.problems:
            print(f"- {what}\n  fix: {fix}")
    else:
        print("\nno problems found")
    if rep.tiny_broken:
        print("\nthe tiny preset cannot run here: fix the problems above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
