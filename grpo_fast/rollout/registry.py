"""The rollout backends by name: each backend declares a ``BACKEND = BackendSpec(...)``.

A backend of ``grpo_fast.rollout`` (a module, or a package such as ``hf/`` and ``vllm/`` whose
``__init__.py`` exports it) declares its name, what it can do, its config checks and how it is
built (``BackendSpec``, in ``rollout/base.py``: a backend imports nothing of the registry);
``backends()`` finds every such module or package of ``grpo_fast.rollout`` by its files, so the
config's choices for ``rollout.backend``, ``make_backend``, the loop and ``grpo-fast doctor`` read
them here. Adding a backend is one module or package (and its tests): no list to edit elsewhere.

Capabilities the rest of the engine asks about instead of a backend's name:

- ``needs_weight_push``: the backend samples from its own copy of the weights (an engine with
  its own memory: the planner counts its rollout peak), so the loop writes a model folder it
  starts from, pushes the policy after every optimizer step and probes the push;
- ``sampler_logprobs``: its rollouts carry the sampled tokens' log-probs (the sampler
  correction and ``rollout.old_logprobs=sampler`` need them);
- ``sleep_mode``: it can free its memory during the training phase (``rollout.sleep_level``).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from grpo_fast.rollout.base import BackendContext, BackendSpec

__all__ = ["BackendContext", "BackendSpec", "backend", "backends"]


_FOUND: dict[str, BackendSpec] | None = None


def backends() -> dict[str, BackendSpec]:
    """Every backend of ``grpo_fast.rollout``, by name: the modules and packages directly in it
    that define ``BACKEND`` (imported once; importing one does not import its engine library,
    e.g. vLLM). A private module (``_name.py``) is never imported here: it may import its engine
    library at the top."""
    global _FOUND
    if _FOUND is None:
        found = {}
        for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
            if info.name.startswith("_"):  # private: it may import its engine library at the top
                continue
            module = importlib.import_module(f"{__package__}.{info.name}")
            spec = getattr(module, "BACKEND", None)
            if isinstance(spec, BackendSpec):
                if spec.name in found:
                    raise RuntimeError(f"two rollout backends are named {spec.name!r}")
                found[spec.name] = spec
        _FOUND = found
    return _FOUND


def backend(name: str) -> BackendSpec:
    """The backend named ``name`` (``KeyError`` when there is none: the config checks first)."""
    return backends()[name]
