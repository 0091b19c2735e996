"""Per-token rate limit on the registration routes (`limits`, sliding window counter, in
memory).

Counted per process: with N replicas or workers a token gets up to N times the limit.
That bounds what one agent can make the broker do per second, which is what it is for;
a shared store (Redis) is not worth a new dependency for it (docs/howto/security.md, Quotas).

The sliding window counter keeps two counters per token and limit: the current window's
and the previous one's, weighted by how much of it still overlaps the last period. The
moving window it replaced kept one entry per call (600 per token at the default limit),
and its in-memory store trimmed them in a task that hopped to a worker thread for every
token it held, after every call: 0.35-0.6 ms of CPU per repeat create_queue with one
agent (docs/decisions/012-sliding-window-rate-limit.md), and more with every token it holds.
"""

from __future__ import annotations

import math
import time

from limits import RateLimitItem, parse_many
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from queuekeeper.exceptions import RateLimited

SETTING = "registration_rate_limit"


class RegistrationLimiter:
    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.items: list[RateLimitItem] = parse_many(spec)
        self.limiter = SlidingWindowCounterRateLimiter(MemoryStorage())

    async def hit(self, key: str) -> None:
        """Count one call for `key` (a token digest); RateLimited when a window is full."""
        for item in self.items:
            if not await self.limiter.hit(item, key):
                stats = await self.limiter.get_window_stats(item, key)
                retry_after = max(1, math.ceil(stats.reset_time - time.time()))
                raise RateLimited(
                    f"Too many registration calls with this token: at most {item} "
                    f"(setting QUEUEKEEPER_{SETTING.upper()}={self.spec!r}); "
                    f"retry after {retry_after} s.",
                    retry_after=retry_after,
                    limit=str(item),
                    setting=SETTING,
                )
