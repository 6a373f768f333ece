"""``python -m grpo_fast.evaluate``: the same as ``grpo-fast evaluate`` (``grpo_fast.tools.evaluate``)."""

from grpo_fast.errors import exit_process
from grpo_fast.tools.evaluate import main

if __name__ == "__main__":
    exit_process(main())
