"""``grpo-fast doctor`` on this machine: versions, CUDA, presets that fit, the Triton check, and
each problem with its fix."""

import importlib.metadata as metadata
from pathlib import Path

import pytest
import torch

from grpo_fast.config import PRESETS
from grpo_fast.tools import doctor


def _rows(text: str) -> dict[str, str]:
    """The report's ``key  value`` lines, keyed by their first 14 columns."""
    w = doctor.KEY_WIDTH
    return {
        line[:w].strip(): line[w + 1 :] for line in text.splitlines() if len(line) > w + 1 and line[w] == " "
    }


def test_doctor_reports_this_machine(capsys):
    assert doctor.main([]) == 0  # this machine runs the tiny preset
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["torch"] == torch.__version__
    assert rows["transformers"] == metadata.version("transformers")
    for lib in doctor.LIBRARIES:
        try:
            assert rows[lib] == metadata.version(lib)
        except metadata.PackageNotFoundError:
            assert rows[lib] == "not installed"
    assert set(PRESETS) <= {k.removeprefix("preset ") for k in rows if k.startswith("preset ")}
    assert rows["preset tiny"].startswith("yes: planned peak")
    if not torch.cuda.is_available():
        assert rows["cuda"].startswith("not available")
        assert rows["preset rtx4090"] == rows["preset h100"] == "no: needs a CUDA GPU"
        # the interpreter ran csrc_triton's kernel against the float64 reference
        assert rows["triton kernels"].startswith("yes, under the interpreter (TRITON_INTERPRET=1, CPU)")
        assert "against the float64 reference" in rows["triton kernels"]


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads Linux's CPU flags")
def test_the_bf16_probe_agrees_with_the_kernels_cpu_flags():
    from grpo_fast.policy.model import cpu_computes_bf16

    flags = {
        f
        for ln in Path("/proc/cpuinfo").read_text().splitlines()
        if ln.startswith("flags")
        for f in ln.split()
    }
    # AMX also needs the kernel's permission for its tiles, which the flags do not show: without
    # it the probe falls back to AVX512-BF16, or to None when the CPU has no AVX512-BF16 either
    allowed = {"AMX"} if "amx_bf16" in flags else set()
    allowed |= {"AVX512-BF16"} if "avx512_bf16" in flags else {None}
    assert cpu_computes_bf16() in allowed, sorted(f for f in flags if "bf16" in f or "amx" in f)


@pytest.mark.parametrize("native", [None, "AMX"])
def test_doctor_says_what_auto_mixed_precision_is_on_this_cpu(monkeypatch, capsys, native):
    from grpo_fast.policy import model as model_mod

    monkeypatch.setattr(model_mod, "cpu_computes_bf16", lambda: native)
    assert doctor.main(["--no-triton"]) == 0
    said = _rows(capsys.readouterr().out)["cpu precision"]
    assert said == (
        "AMX: train.mixed_precision=auto is bf16 autocast on this CPU"
        if native
        else "no native bf16 dot products: train.mixed_precision=auto is fp32 on this CPU"
    )


def test_a_missing_required_package_breaks_tiny_and_names_the_fix(monkeypatch, capsys):
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist == "omegaconf" else real(dist))
    assert doctor.main(["--no-triton"]) == 1
    captured = capsys.readouterr()
    assert "required omegaconf>=2.3 (not installed)" in captured.out
    assert 'fix: pip install "omegaconf>=2.3"' in captured.out
    assert "the tiny preset cannot run here" in captured.err


def test_a_too_old_package_is_a_problem(monkeypatch, capsys):
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: "4.40.0" if dist == "transformers" else real(dist))
    assert doctor.main(["--no-triton"]) == 1
    out = capsys.readouterr().out
    assert "required transformers>=4.56 (4.40.0 installed)" in out


def test_a_failing_triton_kernel_is_reported_with_a_fix_but_tiny_still_runs(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "_TRITON_CHECK", "raise RuntimeError('no compiler for this target')")
    assert doctor.main([]) == 0  # the tiny preset does not need Triton (torch_chunked on a CPU)
    out = capsys.readouterr().out
    assert "triton kernels" in out and "no (" in out and "RuntimeError: no compiler for this target" in out
    assert 'fix: pip install --force-reinstall "triton==' in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU machine's report")
def test_a_cpu_torch_on_a_gpu_machine_names_the_cuda_build(monkeypatch, tmp_path, capsys):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert doctor.main(["--no-triton"]) == 0
    out = capsys.readouterr().out
    assert "this machine has an NVIDIA GPU but torch cannot use it" in out
    assert "fix: pip install --force-reinstall torch==" in out


def test_doctor_says_the_load_and_threads_and_flags_spinning_on_a_busy_machine(monkeypatch):
    """The cpu and threads rows (cores, load, torch's threads, the OpenMP wait, the tiny preset's
    choice); a problem only where the machine is busy and OpenMP spins long (the commands' short
    spin is not). Planted: the problem raised whatever the wait → the passive and short-spin cases
    fail; no load check → the idle case fails."""
    from grpo_fast import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # auto's own choice, not conftest's 1
    follow = "following the machine; threads.intra_op)"
    cases = (
        (3.0, {"OMP_WAIT_POLICY": "active"}, "active", f"1 to start (auto: 2 cores, load 3.0, {follow}", True),
        (3.0, {"OMP_WAIT_POLICY": "PASSIVE"}, "passive",
         "1 to start (auto: a small model (hidden 128), wait passive, 2 cores, load 3.0; threads.intra_op)", False),
        (3.0, {"GOMP_SPINCOUNT": "30000"}, "spin 30000", f"1 to start (auto: 2 cores, load 3.0, {follow}", False),
        (0.4, {"OMP_WAIT_POLICY": "active"}, "active", f"2 to start (auto: 2 cores, load 0.4, {follow}", False),
    )  # fmt: skip
    for load, env, wait, tiny, problem in cases:
        for k in threads.WAIT_ENV:
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(threads, "load_average", lambda load=load: load)
        monkeypatch.setattr(doctor.os, "getloadavg", lambda load=load: (load, 2.0, 1.0))
        rep = doctor.Report()
        doctor.check_threads(rep)
        rows = _rows("\n".join(rep.lines))
        assert rows["cpu"] == f"2 usable cores, load average {load:.2f} 2.00 1.00 (1, 5, 15 min)"
        assert rows["threads"] == (
            f"torch {torch.get_num_threads()} intra-op here, OpenMP wait {wait}; the tiny preset: {tiny}"
        )
        assert bool(rep.problems) == problem, rep.problems
        if problem:
            assert "busy (load 3.0 on 2 cores)" in rep.problems[0][0] and "wait active" in rep.problems[0][0]
