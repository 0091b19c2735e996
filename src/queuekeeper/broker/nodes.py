"""Which broker node to try next, when the AMQP or Management settings list several.

Nodes are tried in the configured order. A node that failed (refused, timed out, 5xx)
moves behind the others for `broker_node_retry_seconds`, so a node that never answers
costs one timeout per window, not one per call; after that it is preferred again in its
configured order, which is how traffic comes back to it once it returns. When every node
has failed they are all still tried, the longest-failed first: a cluster that comes back
is noticed at once. With one URL the order is always that URL, exactly as without a list.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from queuekeeper.observability.metrics import BROKER_NODE_FAILURES

log = structlog.get_logger(__name__)


def node_label(url: str) -> str:
    """`host:port` of a node URL: names a node in logs and `/readyz` without credentials."""
    parts = urlsplit(url)
    default = {"amqp": 5672, "amqps": 5671, "http": 80, "https": 443}.get(parts.scheme)
    return f"{parts.hostname}:{parts.port or default}"


@dataclass
class _Failure:
    since: float
    error: str


class NodeList:
    def __init__(
        self,
        kind: str,
        urls: list[str],
        retry_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError(f"no {kind} node URL configured")
        self.kind = kind
        self.urls = list(urls)
        self.retry_seconds = retry_seconds
        self._clock = clock
        self._failed: dict[str, _Failure] = {}

    def __len__(self) -> int:
        return len(self.urls)

    def order(self) -> list[str]:
        """The nodes to try now, best first."""
        now = self._clock()
        resting = {
            url: failure
            for url, failure in self._failed.items()
            if now - failure.since < self.retry_seconds
        }
        preferred = [url for url in self.urls if url not in resting]
        return preferred + sorted(resting, key=lambda url: resting[url].since)

    def failed(self, url: str, error: str) -> None:
        """`url` did not answer usefully: try the others first for a while."""
        BROKER_NODE_FAILURES.labels(kind=self.kind, node=node_label(url)).inc()
        if url not in self._failed:
            log.warning(
                "broker_node_down",
                kind=self.kind,
                node=node_label(url),
                error=error[:300],
                others=len(self.urls) - 1,
            )
        self._failed[url] = _Failure(self._clock(), error)

    def answered(self, url: str) -> None:
        """`url` answered: it is as good as any other again."""
        failure = self._failed.pop(url, None)
        if failure is not None:
            log.info("broker_node_back", kind=self.kind, node=node_label(url))

    def preferred(self) -> str:
        """The first configured node not known to be failing (an answer since its last
        failure clears that); the first node when all are."""
        return next((url for url in self.urls if url not in self._failed), self.urls[0])

    def down(self) -> dict[str, str]:
        """Nodes whose last attempt failed, by label, with the reason."""
        return {node_label(url): failure.error for url, failure in self._failed.items()}
