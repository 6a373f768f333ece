"""``python -m grpo_fast.report``: the same as ``grpo-fast report`` (``grpo_fast.obs.report``)."""

from grpo_fast.errors import exit_process
from grpo_fast.obs.report import main

if __name__ == "__main__":
    exit_process(main())
