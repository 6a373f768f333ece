"""What the server the hf rollout workers fork from imports once (``multiprocessing``'s
forkserver, started by ``grpo_fast.rollout.hf.process``): torch, the worker's module and the
model code a worker unpickles most often, so that each worker's start is a ``fork`` of a process
that holds them (0.03 s for the tiny model) instead of a fresh interpreter importing them
(spawn: 3.5-3.9 s), measured on 2 idle cores; the server's own start is 4.4-4.8 s, once per
trainer process.

The server is in the trainer's process group: a Ctrl-C leaves it alone (the stdlib's server
ignores SIGINT), a SIGTERM to the group ends it with the run (which stops on that signal), and it
exits when the trainer does (its last client's pipe closes). A worker sets its own signal
dispositions and watches its own lifeline (``process._serve``).
"""

from __future__ import annotations

import contextlib
import logging

import grpo_fast.rollout.hf.process  # noqa: F401  torch, transformers, the decoder

# the tiny and Qwen2.5 models' code, and LoRA's; one that is absent is imported by no worker either.
# peft imports bitsandbytes, whose import logs warnings on a CPU without its optional kernels (and
# offline, the kernels package's own): the server stays quiet, a run with LoRA prints them from
# its own import of peft, and one without never asked for them
logging.disable(logging.WARNING)
try:
    for _name in ("transformers.models.qwen2.modeling_qwen2", "peft"):
        with contextlib.suppress(ImportError):
            __import__(_name)
finally:
    logging.disable(logging.NOTSET)
