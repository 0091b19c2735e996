"""What a publish's outcome means, and what a nack meant for the copy it refused.

RabbitMQ nacks both a publish a full queue refuses and one whose queue process failed
under it (its node killed), and only the first, under `reject-publish-dlx`, leaves a
copy in the dead-letter queue. Telling them apart reads the queue's own arguments and
its effective policy (the Management API) beside the topology rules that set them
(`topology.py`), and the queue's ready messages (a passive declare, which the AMQP
transport in `publisher.py` does). The transport knows only that a publish was nacked;
the verdict is given here, once per queue after a batch's confirms are in.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.topology import (
    CLASSIC,
    DEAD_LETTERING_OVERFLOW,
    QUEUE_TYPE,
    queue_arguments,
)
from queuekeeper.config import Settings

log = structlog.get_logger(__name__)


class Outcome(enum.Enum):
    CONFIRMED = "confirmed"
    # basic.nack from a queue that dead-letters what overflows (`reject-publish-dlx`), seen
    # full after the nack: the broker has dead-lettered the message.
    REJECTED = "rejected"
    # basic.nack that left no copy anywhere: a full queue under `reject-publish` (every
    # quorum queue), or a queue that was not full, so its process failed under the publish
    # (its node lost). To be published again.
    REFUSED = "refused"
    # basic.return: nothing routed it, i.e. the queue does not exist.
    RETURNED = "returned"
    # The vhost refused the connection (missing vhost or permissions).
    VHOST_REFUSED = "vhost_refused"
    # Connection or channel lost, broker unreachable, or no confirm in time.
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    error: str | None = None


# A nack as the transport sees it; `NackVerdict.judge` turns each into REJECTED or REFUSED.
NACKED = Result(Outcome.REFUSED, "nacked by the broker")

# The ready messages of a queue of the vhost being judged, None when it cannot be read.
ReadyMessages = Callable[[str], Awaitable[int | None]]


class NackVerdict:
    """Judges nacked publishes by the queue they were refused by."""

    def __init__(self, settings: Settings, management: ManagementClient | None = None) -> None:
        self.settings = settings
        # Reads a nacked queue's own arguments; without it (benchmarks, some tests) the
        # configured ones stand in.
        self.management = management

    async def judge(
        self,
        vhost: str,
        queues: Sequence[str],
        results: Sequence[Result],
        ready_messages: ReadyMessages,
    ) -> list[Result]:
        """Each nack (`queues[i]` the queue of `results[i]`) as dead-lettered (`REJECTED`)
        or refused with no copy kept (`REFUSED`), looking at each nacked queue once."""
        nacked = list(
            {queue for queue, result in zip(queues, results, strict=True) if result is NACKED}
        )
        verdicts = dict(
            zip(
                nacked,
                await asyncio.gather(
                    *(self._judged(vhost, queue, ready_messages) for queue in nacked)
                ),
                strict=True,
            )
        )
        return [
            verdicts[queue] if result is NACKED else result
            for queue, result in zip(queues, results, strict=True)
        ]

    async def _judged(self, vhost: str, queue: str, ready_messages: ReadyMessages) -> Result:
        """The verdict, within `publish_timeout`. A nack that cannot be judged keeps its copy
        (a duplicate at worst), and never costs the batch's other outcomes."""
        try:
            async with asyncio.timeout(self.settings.publish_timeout):
                return await self._verdict(vhost, queue, ready_messages)
        except Exception as exc:
            log.warning("nack_not_judged", vhost=vhost, queue=queue, error=repr(exc)[:300])
            return Result(
                Outcome.REFUSED,
                f"nacked by the broker; whether its queue was full could not be told "
                f"({type(exc).__name__}); retrying with backoff",
            )

    async def _verdict(self, vhost: str, queue: str, ready_messages: ReadyMessages) -> Result:
        rule = await self.overflow_rule(vhost, queue)
        if rule is None:
            return Result(
                Outcome.REFUSED,
                "nacked by the broker, and its queue is gone: nothing was dead-lettered; "
                "retrying with backoff",
            )
        overflow, limit, byte_limit = rule
        if overflow != DEAD_LETTERING_OVERFLOW:
            return Result(
                Outcome.REFUSED,
                f"nacked by the broker: the queue is full (x-overflow {overflow}: nothing was "
                "dead-lettered) or its process failed; retrying with backoff",
            )
        # A queue that just nacked for being full still holds its limit of ready messages,
        # unless its consumer took one since; then the copy is published again and may also
        # sit in the dead-letter queue: a duplicate, where reading it as full could lose it.
        ready = await ready_messages(queue)
        if ready is not None and byte_limit is not None:
            # Its fill in bytes is not known exactly (only as statistics seconds old); a live
            # queue under a byte limit counts as full, or each retry would be dead-lettered
            # again and crowd other dead letters out of the bounded dead-letter queue.
            return Result(
                Outcome.REJECTED,
                f"nacked by the broker: the queue is full (x-overflow {overflow}, a limit of "
                f"{byte_limit} bytes), the message went to the dead-letter queue",
            )
        if ready is not None and limit is not None and ready >= limit:
            return Result(
                Outcome.REJECTED,
                f"nacked by the broker: the queue is full (x-overflow {overflow}, {ready} of "
                f"{limit} messages ready), the message went to the dead-letter queue",
            )
        seen = "could not be read" if ready is None else f"held {ready} of {limit} messages"
        return Result(
            Outcome.REFUSED,
            f"nacked by the broker while the queue was not full (it {seen}): its process "
            "failed under the publish (a node lost?), nothing was dead-lettered; retrying "
            "with backoff",
        )

    async def overflow_rule(
        self, vhost: str, queue: str
    ) -> tuple[str, int | None, int | None] | None:
        """The queue's `x-overflow`, length limit and byte limit as the broker applies them;
        None when the queue is gone.

        Its own arguments (a queue declared before a setting changed keeps its old ones until
        reconcile can repair it, only when empty, and a full queue is not), with a policy's
        limits where lower (RabbitMQ applies the lower) and its `overflow` where the queue
        has none. Only a classic queue dead-letters on overflow (a quorum queue's
        `reject-publish-dlx` behaves as `drop-head`). Without a Management API client
        (benchmarks, some tests), the configured arguments; when the API fails, its
        ManagementError, so that the copy is kept."""
        policy: dict[str, Any] = {}
        if self.management is None:
            arguments = queue_arguments(self.settings)
            kind = arguments.get(QUEUE_TYPE, CLASSIC)
        else:
            info = await self.management.get_queue(
                vhost, queue, columns="type,arguments,effective_policy_definition"
            )
            if info is None:
                return None
            arguments, policy, kind = info.arguments, info.effective_policy, info.type or CLASSIC
        overflow = arguments.get("x-overflow") or policy.get("overflow") or "drop-head"
        if kind != CLASSIC:
            return f"{overflow} on a {kind} queue", None, None

        def lower(argument: str, key: str) -> int | None:
            limits = [v for v in (arguments.get(argument), policy.get(key)) if isinstance(v, int)]
            return min(limits, default=None)

        return (
            str(overflow),
            lower("x-max-length", "max-length"),
            lower("x-max-length-bytes", "max-length-bytes"),
        )
