"""``python -m grpo_fast.report``: the same as ``grpo-fast report`` (``grpo_fast.obs.report``)."""

import sys

from grpo_fast.obs.report import main

if __name__ == "__main__":
    sys.exit(main())
