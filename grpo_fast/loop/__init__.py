"""The training loop's phases, state and statistics (``grpo_fast.train`` is the outline)."""
