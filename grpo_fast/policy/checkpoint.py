"""Atomic checkpoints: write everything into a temporary folder, then rename it into place.

A checkpoint ``output_dir/checkpoints/step_000100/`` holds the model in Hugging Face format
(``save_pretrained``: loadable by transformers and vLLM), the tokenizer, and
``trainer_state.pt`` with what an exact resume needs: optimizer, LR scheduler, RNG states
(python, numpy, torch CPU and CUDA), the prompt sampler's position, the step, and the state of
the KL controller and health monitor — tensors and plain Python types only, read back with
``torch.load(weights_only=True)`` (a checkpoint is untrusted input: nothing in it is executed). A run killed at any instant leaves either the previous
checkpoint or the new one, never half of one; ``latest_checkpoint`` ignores ``*.tmp`` folders.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from grpo_fast.dist import unwrap
from grpo_fast.errors import CheckpointError, UserError

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain types (``torch.load(weights_only=True)`` reads it):
    python's ``(version, tuple of ints, gauss_next)`` as is, numpy's MT19937 key as an int64
    tensor, torch's CPU and CUDA states as the ByteTensors torch returns."""
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    key = n["key"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], key, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_pretrained_atomic(
    model: torch.nn.Module,
    tokenizer,
    target: Path,
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write model + tokenizer (+ ``trainer_state.pt`` when ``extra``) to ``target`` atomically.

    ``dtype``: write the floating-point weights in this dtype (e.g. ``torch.bfloat16`` for
    serving) instead of the model's own; the model itself is left as it is.
    """
    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)  # a leftover from a run killed mid-write
        tmp.mkdir(parents=True)
        model = unwrap(model)  # DDP
        if dtype is None:
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            _save_pretrained_as(model, tmp, dtype)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            torch.save(extra, tmp / STATE_FILE)
        _fsync_dir(tmp)
    except _WRITE_ERRORS as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # free what was written; target is untouched
        raise CheckpointError(f"cannot write {target}: {_why(exc, target)}") from None
    if target.exists():  # replacing (e.g. the final model of a resumed run): swap, then delete
        old = target.with_name(target.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        os.replace(tmp, target)
    _fsync_dir(target.parent)
    return target


# What a failed write raises: OSError from open/write/fsync (ENOSPC, EACCES, EROFS, ...),
# RuntimeError from torch.save's zip writer, SafetensorError from safetensors (its own type).
_WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, SafetensorError)


def _why(exc: BaseException, target: Path) -> str:
    """One line on a failed write, with the free space left on ``target``'s file system."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        return reason
    return f"{reason} ({free / 2**20:.1f} MiB free there)"


def _save_pretrained_as(model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """``save_pretrained`` with the floating-point weights cast to ``dtype`` one tensor at a time,
    on the CPU (no second copy of the model on the GPU); tied weights stay one tensor, and
    ``config.json`` records ``dtype``."""
    cast: dict[int, torch.Tensor] = {}  # by storage address: tied weights are cast once, stay tied
    state = {}
    for name, t in model.state_dict().items():
        if t.is_floating_point():
            key = t.untyped_storage().data_ptr()
            if key not in cast:
                cast[key] = t.detach().to("cpu", dtype)
            t = cast[key]
        state[name] = t
    saved_dtype = getattr(model.config, "dtype", None)
    try:
        model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    finally:
        model.config.dtype = saved_dtype  # save_pretrained sets it to the model's own dtype
    # transformers 5.24 writes the model's dtype into config.json whatever the state dict holds;
    # record the saved one, which from_pretrained(dtype="auto") and vLLM read.
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir() if path.is_dir() else []:
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    """The folder name of step ``step``'s checkpoint: ``step_000100``."""
    return f"step_{step:06d}"


def save_checkpoint(root: Path, step: int, model, tokenizer, state: dict[str, Any], keep: int) -> Path:
    """Save ``root/step_{step:06d}`` atomically, then delete all but the newest ``keep``.

    A write that fails (disk full, no permission) deletes its temporary folder and raises
    ``CheckpointError`` naming the checkpoint before it, which is left intact and loadable.
    """
    try:
        path = save_pretrained_atomic(model, tokenizer, Path(root) / step_dir_name(step), extra=state)
    except CheckpointError as exc:
        previous = latest_checkpoint(root)
        kept = (
            f"{previous} is intact (resume=true continues from it)" if previous else "no earlier checkpoint"
        )
        raise CheckpointError(f"step {step}: {exc}; {kept}") from None
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return path


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``*.tmp`` leftovers are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def step_folders(root: Path) -> list[Path]:
    """Every ``step_*`` folder under ``root``, complete or not, oldest first (``*.tmp`` leftovers
    of an interrupted write are not among them): what ``check_checkpoint`` is asked about."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def check_checkpoint(path: Path, fix: str) -> None:
    """Refuse a checkpoint folder a resume cannot continue from, before anything loads it:
    ``CheckpointError`` naming what is missing or damaged, with ``fix``, what to do about it.

    Checked, cheaply (no tensor is read): ``trainer_state.pt`` is there and is a whole
    ``torch.save`` archive whose records unpickle with ``weights_only=True`` (memory-mapped:
    a truncated copy, a planted pickle or another program's file is refused here); the weights
    are there (``*.safetensors``, or the ``dcp/.metadata`` of a sharded checkpoint); and every
    model file passes ``check_model_folder``.

    Example: ``check_checkpoint(Path("runs/x/checkpoints/step_000002"), "delete it")`` →
    ``CheckpointError("checkpoint runs/x/checkpoints/step_000002 has no trainer_state.pt (the
    optimizer, schedule and step a resume needs); delete it")``.
    """
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {STATE_FILE} (the optimizer, schedule and step a resume needs); {fix}"
        )
    if not (any(path.glob("*.safetensors")) or (path / "dcp" / ".metadata").is_file()):
        raise CheckpointError(f"checkpoint {path} has no model weights (*.safetensors); {fix}")
    check_model_folder(path, fix)
    load_state(path, mmap=True, fix=fix)


def checkpoint_problem(path: Path) -> str | None:
    """``check_checkpoint``'s line without a fix (``"checkpoint P has no trainer_state.pt (...)"``),
    or None for a complete checkpoint: for lines that say what a folder holds."""
    try:
        check_checkpoint(path, "")
    except CheckpointError as exc:
        return str(exc).removesuffix("; ")
    return None


def load_state(path: Path, mmap: bool = False, fix: str | None = None) -> dict[str, Any]:
    """``path/trainer_state.pt``, read with ``torch.load(weights_only=True)``: tensors and plain
    Python types only, so a tampered or foreign file cannot run code; anything else is refused
    (``CheckpointError``, naming the file) before a single object of it is built.

    ``mmap``: map the tensors' bytes instead of reading them (a check of the file's structure
    that costs no memory); ``fix``: what the error says to do (default: resume from the
    checkpoint before)."""
    file = Path(path) / STATE_FILE
    fix = "delete the folder to resume from the one before" if fix is None else fix
    if mmap and file.is_file() and not zipfile.is_zipfile(file):  # what mmap needs, said plainly
        raise CheckpointError(
            f"checkpoint file {file} cannot be read (not a whole torch.save archive: "
            f"{file.stat().st_size} bytes, truncated or written by another program); {fix}"
        )
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line or "nsupported" in line), lines[0])
        raise CheckpointError(
            f"checkpoint file {file} is refused: it holds more than tensors and plain types "
            f"({reason}); trainer state is loaded with torch.load(weights_only=True), so a file "
            f"tampered with or written by another program is never run — {fix}"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        why = " ".join(str(exc).split()).split(". ")[0][:200]  # torch's first sentence
        raise CheckpointError(f"checkpoint file {file} cannot be read ({why}); {fix}") from None


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Load the safetensors weights saved by ``save_pretrained`` into ``model`` (same architecture);
    for a LoRA policy, the adapter its checkpoints hold."""
    from safetensors.torch import load_file

    from grpo_fast.policy.lora import is_lora, load_adapter_weights

    if is_lora(model):
        load_adapter_weights(model, Path(path))
        return

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UserError(f"checkpoint {path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    model = unwrap(model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = (
        {k for k in missing if k.endswith("lm_head.weight")}
        if getattr(model.config, "tie_word_embeddings", False)
        else set()
    )
    if set(missing) - tied or unexpected:
        raise UserError(
            f"checkpoint {path} does not match the model: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
        )
    if tied:
        model.tie_weights()


# The JSON files of a Hugging Face model folder (and of a peft adapter's), each checked to parse.
_JSON_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "adapter_config.json",
    "model.safetensors.index.json",
)


def check_model_folder(path: str | Path, fix: str) -> None:
    """Refuse a damaged model folder before anything loads it: ``CheckpointError`` naming the
    first file whose JSON does not parse or whose safetensors header or length is wrong (a
    truncated or corrupted file: a full disk, a copy cut short), with ``fix``, what to do about
    it. A path that is not a folder (a hub name, ``builtin:tiny``) is left alone.

    Example: ``check_model_folder("runs/tiny/final", "re-save it")`` →
    ``CheckpointError("model file runs/tiny/final/model.safetensors is damaged (its header
    promises 1787680 bytes of tensors, the file has 1048568 after it); re-save it")``.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    for name in _JSON_FILES:
        file = folder / name
        if file.is_file():
            try:
                json.loads(file.read_bytes().decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise CheckpointError(
                    f"model file {file} is damaged (not valid JSON: {exc}); {fix}"
                ) from None
    for file in sorted(folder.glob("*.safetensors")):
        why = _safetensors_damage(file)
        if why is not None:
            raise CheckpointError(f"model file {file} is damaged ({why}); {fix}")


def _safetensors_damage(file: Path) -> str | None:
    """What is wrong with a safetensors file's layout (8-byte header length, JSON header, tensor
    bytes up to the largest data offset), or None: read from its header, no tensor loaded."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{size} bytes: shorter than a safetensors header"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"its header length {n} exceeds the file's {size} bytes"
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError):
            return "its header is not valid safetensors JSON"
    data = size - 8 - n
    if max(ends, default=0) != data:
        return f"its header promises {max(ends, default=0)} bytes of tensors, the file has {data} after it"
    return None
