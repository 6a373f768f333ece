"""The ``grpo-fast`` command: one entry point for every tool of the package.

    grpo-fast train    [--preset NAME] [--config F.yaml ...] [--dry-run] [--nproc-per-node N] [key=value ...]
    grpo-fast evaluate --model PATH [--preset NAME] [key=value ...]
    grpo-fast plan     [--preset NAME] [--gpu-mem-gb N] [key=value ...]
    grpo-fast report   RUN_DIR
    grpo-fast sweep    --preset NAME --sweep lr|baseline|length_norm [...]
    grpo-fast doctor
    grpo-fast sandbox  FILE.py [--timeout S] [--memory-mb M]

Each subcommand is its ``python -m grpo_fast.X`` form (same arguments, same exit codes: 0 done,
2 a bad input named in one line; ``sandbox``: 1 when the code failed or hit a limit).
``train --dry-run`` (``grpo_fast.tools.dry_run``) resolves everything a run would — the config
with each value's source, the memory plan, the data and a prompt as the model sees it — and exits
without loading the model.

This is the top floor: nothing in the package imports it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from grpo_fast.config import presets_and_keys_help
from grpo_fast.errors import cwd_on_path, exit_process

COMMANDS = {
    "train": ("grpo_fast.train", "GRPO training (--dry-run: resolve and print, load no model)"),
    "evaluate": ("grpo_fast.tools.evaluate", "zero-shot accuracy of a checkpoint or hub model"),
    "plan": ("grpo_fast.tools.plan", "the memory budget of a preset on a GPU"),
    "report": ("grpo_fast.obs.report", "plots and a summary of a run directory"),
    "sweep": ("grpo_fast.obs.sweep", "ablation runs plotted together"),
    "doctor": ("grpo_fast.tools.doctor", "this machine: versions, CUDA, presets that fit, Triton"),
    "sandbox": ("grpo_fast.tools.sandbox", "run a Python file as a rollout's tool call; what the model sees"),
}

WITH_PRESETS = ("evaluate", "plan", "sweep")  # the other commands that take --preset and key=value


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items())
    return (
        "usage: grpo-fast COMMAND [ARGS ...]   (grpo-fast COMMAND --help for its arguments)\n\n"
        f"commands:\n{rows}\n\n{presets_and_keys_help()}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), end="")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    prog = f"grpo-fast {name}"  # usage lines as the user typed the command
    if name == "train":  # its own --help lists the presets and keys
        return module.main(rest, prog=prog)
    if name in WITH_PRESETS and any(a in ("-h", "--help") for a in rest):
        try:
            return module.main(rest, prog=prog)
        finally:  # argparse exits after printing the help: add the presets and keys below it
            print(f"\n{presets_and_keys_help()}")
    return module.main(rest, prog=prog)


def entry() -> None:
    """The console script (``pyproject.toml``): ``main``'s exit code, at once after a signal.
    The working directory goes on the import path first, as ``python -m grpo_fast.cli`` has it,
    so that a user's module there (``data.reward=my_rewards:exact``) imports the same way."""
    cwd_on_path()
    exit_process(main())


if __name__ == "__main__":
    entry()
