"""``python -m grpo_fast.plan``: the same as ``grpo-fast plan`` (``grpo_fast.tools.plan``)."""

from grpo_fast.errors import exit_process
from grpo_fast.tools.plan import main

if __name__ == "__main__":
    exit_process(main())
