"""``python -m grpo_fast.doctor``: the same as ``grpo-fast doctor`` (``grpo_fast.tools.doctor``)."""

import sys

from grpo_fast.tools.doctor import main

if __name__ == "__main__":
    sys.exit(main())
