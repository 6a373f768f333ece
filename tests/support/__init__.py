"""Test plumbing (the pytest hooks, the rank harness, stand-ins): tests/ only, not the package.

What the benchmarks use too (the tolerance rule, input builders, workloads, the tiny vLLM engine)
stays in ``grpo_fast.testing``. pytest puts tests/ on ``sys.path`` (its rootdir conftest), and a
spawned rank inherits it, so ``from support.ranks import join_cpu_ranks`` works in both.
"""
