"""``python -m grpo_fast.doctor``: the same as ``grpo-fast doctor`` (``grpo_fast.tools.doctor``)."""

from grpo_fast.errors import exit_process
from grpo_fast.tools.doctor import main

if __name__ == "__main__":
    exit_process(main())
