"""What exercise 9.2's check puts around the learner's connector (the check itself is in the notebook)."""
from __future__ import annotations

from typing import Any


class AvailableTokens:
    """A connector mixin for 9.2's probes: ``_num_available_tokens`` answers from ``self.available`` (request id ->
    leading prompt tokens with K/V outside, or ``None``: not known yet) instead of reading files. ``available`` is an
    instance attribute, so it goes with the connector wherever the learner's method runs (when graded, in the
    answer's process)."""

    available: dict[str, int | None]

    def _num_available_tokens(self, request: Any) -> int | None:
        return self.available[request.request_id]
