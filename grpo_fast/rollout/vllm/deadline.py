"""The limits every wait on a vLLM engine apart from the trainer runs under (``rollout.placement=
process|server``): ``Timeouts`` (``rollout.start_timeout``, ``request_timeout``, ``sync_timeout``)
and ``Deadline``, whose expiry raises ``EngineTimeout`` naming what was waited for, for how long,
and the config key that sets the limit. The placements (``placement/process.py``,
``placement/server.py``) and the weight transport (``transfer/transport.py``) wait under them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from grpo_fast.errors import EngineTimeout


@dataclass(frozen=True)
class Timeouts:
    """Seconds: an engine's start (``rollout.start_timeout``), one ``generate`` call
    (``rollout.request_timeout``), one weight sync (``rollout.sync_timeout``)."""

    start: float
    request: float
    sync: float


class Deadline:
    """``seconds`` from now, for ``what`` (a phrase: "the weight sync of step 3").

    ``left(doing)`` is the time that remains, or raises ``EngineTimeout`` naming ``what`` and
    ``doing`` once none does."""

    def __init__(self, seconds: float, what: str, key: str):
        self.seconds = float(seconds)
        self.what = what
        self.key = key  # the config key that sets the timeout
        self.end = time.monotonic() + self.seconds

    def left(self, doing: str = "") -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise self.expired(doing)
        return remaining

    def expired(self, doing: str = "") -> EngineTimeout:
        at = f" (waiting for {doing})" if doing else ""
        return EngineTimeout(
            f"{self.what} did not finish within {self.seconds:g} s{at}; {self.key} sets this limit"
        )
