"""``python -m grpo_fast.sweep``: the same as ``grpo-fast sweep`` (``grpo_fast.obs.sweep``)."""

import sys

from grpo_fast.obs.sweep import main

if __name__ == "__main__":
    sys.exit(main())
