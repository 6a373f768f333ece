"""What the run-folder tests share (tests/test_run_folder.py, tests/test_user_inputs.py): the
quick tiny run they train, a finished run to copy, a folder's checksums; and, for tests/conftest.py,
a cheap fingerprint of the user's run folders."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

# a tiny run of a few seconds: no warm start or eval, a checkpoint every step
QUICK = [
    "--preset",
    "tiny",
    "sft.steps=0",
    "eval_every=0",
    "checkpoint_every=1",
    "rollout.batch_size=16",
    "train.micro_batch_size=16",
    "logging.progress=false",
    "logging.sample_every=0",
]


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (the lock file too) → its sha256: a folder's checksums."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def stat_tree(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every path under ``folder`` (``folder`` itself as ``"."``) → ``(kind, size, mtime in ns)``;
    {} when it does not exist. Reads no file: a user's runs/ may hold gigabytes of checkpoints."""
    if not folder.exists() and not folder.is_symlink():
        return {}
    found = {}
    for p in [folder, *sorted(folder.rglob("*"))]:
        st = p.lstat()
        kind = "link" if p.is_symlink() else "dir" if p.is_dir() else "file"
        found[str(p.relative_to(folder))] = (kind, st.st_size if kind == "file" else 0, st.st_mtime_ns)
    return found


def finished_run(tmp_path_factory) -> Path:
    """A finished 2-step run (checkpoints, final model, metrics), for a module's fixture."""
    from grpo_fast.train import main

    out = tmp_path_factory.mktemp("finished") / "run"
    assert main([*QUICK, "steps=2", f"output_dir={out}"]) == 0
    return out


def copy_folder(src: Path, dst: Path) -> Path:
    """``src`` copied to ``dst`` with its times and modes (``cp -a``), for a test that changes it."""
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst
