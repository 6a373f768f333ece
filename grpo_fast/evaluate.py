"""``python -m grpo_fast.evaluate``: the same as ``grpo-fast evaluate`` (``grpo_fast.tools.evaluate``)."""

import sys

from grpo_fast.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
