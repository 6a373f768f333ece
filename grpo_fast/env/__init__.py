"""Tool environments for multi-turn rollouts: what ends a turn, what it asks, how a batch of
requests runs, what goes back into the context (``base``). Built in: ``python`` (code in the
sandbox, the tool-integrated-reasoning format) and ``calculator`` (exact arithmetic). A module
each, found by ``registry``."""

from grpo_fast.env.base import (
    Environment,
    EnvironmentSpec,
    OutputLimit,
    ToolCall,
    ToolResult,
    split_stop,
    truncate,
)
from grpo_fast.env.registry import environment, environments, make_environment

__all__ = [
    "Environment",
    "EnvironmentSpec",
    "OutputLimit",
    "ToolCall",
    "ToolResult",
    "environment",
    "environments",
    "make_environment",
    "split_stop",
    "truncate",
]
