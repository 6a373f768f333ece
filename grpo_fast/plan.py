"""``python -m grpo_fast.plan``: the same as ``grpo-fast plan`` (``grpo_fast.tools.plan``)."""

import sys

from grpo_fast.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
