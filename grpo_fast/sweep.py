"""``python -m grpo_fast.sweep``: the same as ``grpo-fast sweep`` (``grpo_fast.obs.sweep``)."""

from grpo_fast.errors import exit_process
from grpo_fast.obs.sweep import main

if __name__ == "__main__":
    exit_process(main())
