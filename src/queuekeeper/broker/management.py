"""A thin, typed client for the RabbitMQ Management HTTP API (one node, or a cluster's).

Errors keep the broker's own `reason` text, because that text is what tells an
operator what happened ("inequivalent arg 'x-message-ttl' …", "vhost_not_found").
"""

from __future__ import annotations

import asyncio
import base64
import re
import ssl
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import httpx
import structlog
from httpx_aiohttp import AiohttpTransport

from queuekeeper.broker.nodes import NodeList
from queuekeeper.broker.passwords import HASHING_ALGORITHM
from queuekeeper.broker.topology import Permissions
from queuekeeper.config import Settings

log = structlog.get_logger(__name__)

# Called after every call with (endpoint kind, status or "error", seconds); metrics hook in here.
CallObserver = Callable[[str, str, float], None]


def parse_tags(value: Any) -> tuple[str, ...]:
    """The broker answers tags as a list (3.10) or a comma-separated string (older)."""
    if isinstance(value, str):
        return tuple(tag for tag in value.split(",") if tag)
    return tuple(str(tag) for tag in value or [])


def _count(value: Any) -> int | None:
    """A statistic; None when the broker has not computed it (yet)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class QueueInfo:
    """A queue as the Management API describes it; absent columns are None."""

    name: str
    vhost: str
    arguments: dict[str, Any] = field(default_factory=dict)
    durable: bool | None = None
    auto_delete: bool | None = None
    type: str | None = None
    messages: int | None = None
    messages_ready: int | None = None
    messages_unacknowledged: int | None = None
    consumers: int | None = None
    # What the vhost's policies and operator policies set on it (`max-length`, `overflow`...).
    effective_policy: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: dict[str, Any], vhost: str) -> QueueInfo:
        arguments = body.get("arguments")
        durable, auto_delete = body.get("durable"), body.get("auto_delete")
        policy = body.get("effective_policy_definition")  # `[]` when no policy applies
        return cls(
            name=str(body.get("name") or ""),
            vhost=str(body.get("vhost") or vhost),
            arguments=dict(arguments) if isinstance(arguments, dict) else {},
            durable=durable if isinstance(durable, bool) else None,
            auto_delete=auto_delete if isinstance(auto_delete, bool) else None,
            type=str(body["type"]) if body.get("type") is not None else None,
            messages=_count(body.get("messages")),
            messages_ready=_count(body.get("messages_ready")),
            messages_unacknowledged=_count(body.get("messages_unacknowledged")),
            consumers=_count(body.get("consumers")),
            effective_policy=dict(policy) if isinstance(policy, dict) else {},
        )


@dataclass(frozen=True)
class QueuePage:
    """One page of a vhost's queues; `page_count` as the broker counted at that moment."""

    items: list[QueueInfo]
    page: int
    page_count: int


@dataclass(frozen=True)
class BrokerOverview:
    """What `GET /api/overview` is asked for: the cluster's RabbitMQ version ("3.13.7")."""

    rabbitmq_version: str

    @classmethod
    def parse(cls, body: dict[str, Any]) -> BrokerOverview:
        return cls(rabbitmq_version=str(body.get("rabbitmq_version") or ""))


@dataclass(frozen=True)
class VhostInfo:
    name: str
    tags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, body: dict[str, Any]) -> VhostInfo:
        return cls(name=str(body.get("name") or ""), tags=parse_tags(body.get("tags")))


@dataclass(frozen=True)
class UserInfo:
    name: str
    tags: tuple[str, ...] = ()
    password_hash: str = ""

    @classmethod
    def parse(cls, body: dict[str, Any]) -> UserInfo:
        return cls(
            name=str(body.get("name") or ""),
            tags=parse_tags(body.get("tags")),
            password_hash=str(body.get("password_hash") or ""),
        )


@dataclass(frozen=True)
class Permission:
    """A user's rights in a vhost."""

    user: str
    vhost: str
    configure: str
    write: str
    read: str

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Permission:
        return cls(
            user=str(body.get("user") or ""),
            vhost=str(body.get("vhost") or ""),
            configure=str(body.get("configure")),
            write=str(body.get("write")),
            read=str(body.get("read")),
        )

    @property
    def permissions(self) -> Permissions:
        return Permissions(configure=self.configure, write=self.write, read=self.read)


@dataclass(frozen=True)
class ConsumerInfo:
    """One consumer of a queue, and the connection it came on (its channel's details)."""

    queue: str
    vhost: str
    consumer_tag: str
    connection_name: str
    peer_host: str | None = None
    peer_port: int | None = None

    @classmethod
    def parse(cls, body: dict[str, Any], vhost: str) -> ConsumerInfo:
        queue = body.get("queue")
        channel = body.get("channel_details")
        queue = queue if isinstance(queue, dict) else {}
        channel = channel if isinstance(channel, dict) else {}
        host, port = channel.get("peer_host"), channel.get("peer_port")
        return cls(
            queue=str(queue.get("name") or ""),
            vhost=str(queue.get("vhost") or vhost),
            consumer_tag=str(body.get("consumer_tag") or ""),
            connection_name=str(channel.get("connection_name") or ""),
            peer_host=host if isinstance(host, str) else None,
            peer_port=_count(port),
        )


@dataclass(frozen=True)
class ConnectionInfo:
    """A client connection: who is on the other end, since when, and with what client."""

    name: str
    peer_host: str | None
    peer_port: int | None
    connected_at: datetime | None
    client: str | None  # product and version from the client's properties, else the protocol
    vhost: str | None = None

    @classmethod
    def tracked(cls, body: dict[str, Any]) -> ConnectionInfo:
        """A connection as the broker's connection tracking lists it (`/connections/username/`):
        exact at once, but only its name, vhost, user and node. RabbitMQ names a connection
        `<peer host>:<peer port> -> <own host>:<own port>` (an IPv6 host in brackets), so the
        peer is read from the name; when and with what client it came, only its statistics
        say (`with_details`)."""
        name = str(body.get("name") or "")
        host, port = _peer_of(name)
        vhost = body.get("vhost")
        return cls(name, host, port, None, None, vhost if isinstance(vhost, str) else None)

    def with_details(self, listed: ConnectionInfo | None) -> ConnectionInfo:
        """This connection with what its statistics know, once they have arrived."""
        if listed is None:
            return self
        return ConnectionInfo(
            self.name,
            listed.peer_host or self.peer_host,
            listed.peer_port if listed.peer_port is not None else self.peer_port,
            listed.connected_at,
            listed.client,
            self.vhost,
        )

    @classmethod
    def parse(cls, body: dict[str, Any]) -> ConnectionInfo:
        at = body.get("connected_at")  # milliseconds since the epoch
        properties = body.get("client_properties")
        properties = properties if isinstance(properties, dict) else {}
        product, version = properties.get("product"), properties.get("version")
        client = " ".join(str(part) for part in (product, version) if part) or None
        protocol = body.get("protocol")
        host = body.get("peer_host")
        return cls(
            name=str(body.get("name") or ""),
            peer_host=host if isinstance(host, str) else None,
            peer_port=_count(body.get("peer_port")),
            connected_at=(
                datetime.fromtimestamp(at / 1000, UTC)
                if isinstance(at, int | float) and not isinstance(at, bool)
                else None
            ),
            client=client or (str(protocol) if protocol else None),
        )


_CONNECTION_NAME = re.compile(r"^\[?(?P<host>[^\]]*?)\]?:(?P<port>\d+) -> ")


def _peer_of(name: str) -> tuple[str | None, int | None]:
    match = _CONNECTION_NAME.match(name)
    return (match["host"], int(match["port"])) if match else (None, None)


def _dicts(body: Any) -> list[dict[str, Any]]:
    return [item for item in body if isinstance(item, dict)] if isinstance(body, list) else []


class ManagementError(Exception):
    """The Management API refused a call. `reason` is the broker's text."""

    def __init__(
        self, message: str, *, status: int | None = None, reason: str = "", path: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.path = path


class BrokerUnavailable(ManagementError):
    """Unreachable, timed out, 5xx, or our credentials were refused: retry later."""


class ManagementNotFound(ManagementError):
    @property
    def vhost_not_found(self) -> bool:
        return "vhost_not_found" in self.reason


class ManagementBadRequest(ManagementError):
    @property
    def inequivalent(self) -> bool:
        return "inequivalent arg" in self.reason


class UnsafeName(ManagementError):
    """A name that cannot be one path segment of a Management API URL (empty, `.`, `..`)."""


def _q(name: str) -> str:
    # quote() leaves `.` and `..` as they are, and both httpx and the broker resolve dot
    # segments (`/vhosts/..` reaches `/api`; `%2E%2E` is decoded first): refuse them.
    if name in ("", ".", ".."):
        raise UnsafeName(f"{name!r} cannot be a vhost, user or queue name", reason="unsafe name")
    return quote(name, safe="")


def _ssl_context(settings: Settings) -> ssl.SSLContext | bool:
    if not settings.tls_verify:
        return False
    if urlsplit(settings.management_urls[0]).scheme != "https":  # one scheme for all nodes
        # Plain HTTP: nothing to verify, and loading the CA store cost ~25 ms of CPU per
        # client. A context that trusts no CA would refuse any certificate (fails closed).
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context = ssl.create_default_context(cafile=settings.tls_ca_file)
    if settings.tls_cert_file:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return context


# A queue's definition and the counts the queue itself answers (`enable_queue_totals`
# without statistics): exact the moment they change, where the statistics' counts lag the
# broker's collection interval (docs/decisions/028-status-without-lag.md).
_TOTALS_COLUMNS = (
    "name,vhost,durable,auto_delete,arguments,type,messages,messages_ready,messages_unacknowledged"
)
# Queues asked for in one call: their names go into the URL as one regular expression,
# which stays well below the broker's 8,000-byte request line.
QUEUES_PER_CALL = 40

# A queue's fields that the broker answers without computing its statistics.
_DEFINITION_COLUMNS = frozenset(
    {"name", "vhost", "durable", "auto_delete", "exclusive", "arguments", "type", "node", "state"}
)


def _queue_columns(columns: str) -> dict[str, str]:
    """The query for `columns` of a queue or a page of them. Asking for none of its statistics,
    it says `disable_stats` and the broker skips computing them: 0.85 -> 0.65 ms of its CPU
    for one queue, measured on this machine (docs/decisions/010-management-api-client.md)."""
    if _DEFINITION_COLUMNS.issuperset(columns.split(",")):
        return {"columns": columns, "disable_stats": "true"}
    return {"columns": columns}


def _describe(exc: httpx.TransportError) -> str:
    """The error as an operator should read it: named by aiohttp's own exception, which the
    transport maps onto httpx's coarsely (a refused connection or a certificate that fails
    verification arrives as `ConnectTimeout`)."""
    return f"{type(exc.__cause__ or exc).__name__}: {exc}"


def _basic_auth(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


class ManagementClient:
    def __init__(
        self,
        settings: Settings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        observer: CallObserver | None = None,
    ) -> None:
        self._observer = observer
        # aiohttp underneath, httpx's types on top: the same requests, responses and
        # exceptions as httpx's own transport (httpcore), for 0.7 ms of CPU less per call
        # (docs/decisions/010-management-api-client.md). It makes no connect retry of its
        # own: `_request` retries every transport error, on this node or the next.
        self._transport = transport or AiohttpTransport(verify=_ssl_context(settings))
        self._nodes = NodeList(
            "management", settings.management_urls, settings.broker_node_retry_seconds
        )
        self._headers = {
            "authorization": _basic_auth(settings.management_user, settings.management_password),
            "content-type": "application/json",
            "accept-encoding": "gzip, deflate",
        }
        self._timeout = httpx.Timeout(settings.management_timeout).as_dict()

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def _send(
        self, method: str, url: str, *, json: Any = None, params: dict[str, Any] | None = None
    ) -> httpx.Response:
        """One call through httpx's transport API, read in full. Not `AsyncClient.request`:
        its per-call layers (auth flow, cookie jar, redirects, URL merging) do nothing for a
        Management API call and cost 0.3-0.5 ms of CPU each time here (`python -m
        bench._management_call`; docs/decisions/010-management-api-client.md)."""
        request = httpx.Request(method, url, params=params, json=json, headers=self._headers)
        request.extensions = {"timeout": self._timeout}
        try:
            response = await self._transport.handle_async_request(request)
            try:
                await response.aread()
            finally:
                await response.aclose()
        except aiohttp.ClientError as exc:
            # The transport maps only some of aiohttp's errors onto httpx's: an answer that is
            # not HTTP arrives as ClientResponseError. Every failure of the call is httpx's.
            raise httpx.TransportError(str(exc), request=request) from exc
        return response

    async def _request(
        self,
        method: str,
        path: str,
        kind: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        attempts: int = 2,
    ) -> httpx.Response:
        # Every call we make is idempotent (GET/PUT/DELETE), so a retry on a timeout or 5xx,
        # on the same node or the next one, cannot do anything twice that matters. A node
        # that failed goes to the back of the order, so each retry asks the next node.
        tries = attempts + len(self._nodes) - 1
        for attempt in range(tries):
            node = self._nodes.order()[0]
            started = time.perf_counter()
            try:
                response = await self._send(method, f"{node}/api{path}", json=json, params=params)
            except httpx.TransportError as exc:
                self._observe(kind, "error", started)
                self._nodes.failed(node, _describe(exc))
                if attempt + 1 < tries:
                    continue
                raise BrokerUnavailable(
                    f"RabbitMQ Management API unreachable ({_describe(exc)})", path=path
                ) from exc
            self._observe(kind, str(response.status_code), started)
            if response.status_code >= 500:
                self._nodes.failed(node, f"answered {response.status_code}")
                if attempt + 1 < tries:
                    await asyncio.sleep(0.05 * attempt)
                    continue
            else:
                self._nodes.answered(node)
            return self._check(response, path)
        raise AssertionError("unreachable")  # pragma: no cover

    def _observe(self, kind: str, status: str, started: float) -> None:
        if self._observer is not None:
            self._observer(kind, status, time.perf_counter() - started)

    @staticmethod
    def _check(response: httpx.Response, path: str) -> httpx.Response:
        status = response.status_code
        if status < 400:
            return response
        try:
            body = response.json()
            reason = str(body.get("reason") or body.get("error") or "")
        except (ValueError, AttributeError):
            reason = response.text[:500]
        message = f"Management API answered {status} for {path}: {reason}"
        if status == 404:
            raise ManagementNotFound(message, status=status, reason=reason, path=path)
        if status == 400:
            raise ManagementBadRequest(message, status=status, reason=reason, path=path)
        if status in (401, 403):
            raise BrokerUnavailable(
                f"Management API refused queuekeeper's credentials ({status}): {reason}",
                status=status,
                reason=reason,
                path=path,
            )
        if status >= 500:
            raise BrokerUnavailable(message, status=status, reason=reason, path=path)
        raise ManagementError(message, status=status, reason=reason, path=path)

    @staticmethod
    def _json(response: httpx.Response, path: str) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise BrokerUnavailable(
                f"Management API sent a body that is not JSON for {path}", path=path
            ) from exc

    async def _get_or_none(self, path: str, kind: str, **params: Any) -> dict[str, Any] | None:
        try:
            response = await self._request("GET", path, kind, params=params or None)
        except ManagementNotFound:
            return None
        body = self._json(response, path)
        if not isinstance(body, dict):
            raise BrokerUnavailable(f"Management API sent an unexpected body for {path}", path=path)
        return body

    async def _delete(self, path: str, kind: str, **params: Any) -> bool:
        try:
            await self._request("DELETE", path, kind, params=params or None)
        except ManagementNotFound:
            return False
        return True

    # --- cluster -----------------------------------------------------------------------
    async def overview(self) -> BrokerOverview:
        body = await self._get_or_none("/overview", "overview", columns="rabbitmq_version")
        return BrokerOverview.parse(body or {})

    async def node_overview(self, node_url: str) -> None:
        """Ask that one node, not the cluster: readiness reports each node by itself."""
        response = await self._send(
            "GET", f"{node_url.rstrip('/')}/api/overview", params={"columns": "rabbitmq_version"}
        )
        self._check(response, "/overview")

    # --- vhosts ---------------------------------------------------------------------------
    async def get_vhost(self, name: str) -> VhostInfo | None:
        body = await self._get_or_none(f"/vhosts/{_q(name)}", "vhost")
        return VhostInfo.parse(body) if body is not None else None

    async def list_vhosts(self) -> list[VhostInfo]:
        response = await self._request("GET", "/vhosts", "vhost", params={"columns": "name,tags"})
        return [VhostInfo.parse(item) for item in _dicts(self._json(response, "/vhosts"))]

    async def put_vhost(self, name: str, *, description: str, tags: list[str]) -> None:
        await self._request(
            "PUT",
            f"/vhosts/{_q(name)}",
            "vhost",
            json={"description": description, "tags": ",".join(tags)},
        )

    async def delete_vhost(self, name: str) -> bool:
        return await self._delete(f"/vhosts/{_q(name)}", "vhost")

    # --- users and permissions ------------------------------------------------------
    async def get_user(self, name: str) -> UserInfo | None:
        body = await self._get_or_none(f"/users/{_q(name)}", "user")
        return UserInfo.parse(body) if body is not None else None

    async def list_users(self, columns: str = "name,tags") -> list[UserInfo]:
        # RabbitMQ 3.10 answers 500 when a user is deleted while it builds this
        # list (measured: 13 of 300 listings during concurrent deletes), so retry harder.
        response = await self._request(
            "GET", "/users", "user", params={"columns": columns}, attempts=6
        )
        return [UserInfo.parse(item) for item in _dicts(self._json(response, "/users"))]

    async def put_user(self, name: str, *, password_hash: str, tags: list[str]) -> None:
        await self._request(
            "PUT",
            f"/users/{_q(name)}",
            "user",
            json={
                "password_hash": password_hash,
                "hashing_algorithm": HASHING_ALGORITHM,
                "tags": ",".join(tags),
            },
        )

    async def delete_user(self, name: str) -> bool:
        return await self._delete(f"/users/{_q(name)}", "user")

    async def get_permissions(self, vhost: str, user: str) -> Permission | None:
        body = await self._get_or_none(f"/permissions/{_q(vhost)}/{_q(user)}", "permission")
        return Permission.parse(body) if body is not None else None

    async def list_permissions(self) -> list[Permission]:
        """Every (user, vhost) permission on the broker, in one call."""
        response = await self._request(
            "GET",
            "/permissions",
            "permission",
            params={"columns": "user,vhost,configure,write,read"},
        )
        return [Permission.parse(item) for item in _dicts(self._json(response, "/permissions"))]

    async def put_permissions(self, vhost: str, user: str, permissions: Permissions) -> None:
        await self._request(
            "PUT",
            f"/permissions/{_q(vhost)}/{_q(user)}",
            "permission",
            json=permissions.as_body(),
        )

    # --- queues ------------------------------------------------------------------------
    async def put_queue(self, vhost: str, name: str, *, arguments: dict[str, Any]) -> bool:
        """Declare a durable queue; True when it was created, False when it existed."""
        response = await self._request(
            "PUT",
            f"/queues/{_q(vhost)}/{_q(name)}",
            "queue",
            json={"durable": True, "auto_delete": False, "arguments": arguments},
        )
        return response.status_code == 201

    async def get_queue(
        self, vhost: str, name: str, columns: str = "name,durable,auto_delete,arguments"
    ) -> QueueInfo | None:
        path = f"/queues/{_q(vhost)}/{_q(name)}"
        body = await self._get_or_none(path, "queue", **_queue_columns(columns))
        return QueueInfo.parse(body, vhost) if body is not None else None

    async def queues_now(self, vhost: str, names: Collection[str]) -> dict[str, QueueInfo]:
        """These queues of `vhost` that exist, with their definitions and the counts their
        queue processes hold now (`messages_ready`, `messages_unacknowledged`, `messages`;
        `consumers` is not among them): one call per QUEUES_PER_CALL names, none lagging the
        statistics (docs/decisions/028-status-without-lag.md)."""
        wanted = sorted(set(names))
        found: dict[str, QueueInfo] = {}
        path = f"/queues/{_q(vhost)}"
        for start in range(0, len(wanted), QUEUES_PER_CALL):
            chunk = wanted[start : start + QUEUES_PER_CALL]
            params = {
                "disable_stats": "true",
                "enable_queue_totals": "true",
                "columns": _TOTALS_COLUMNS,
                "pagination": "true",
                "page": 1,
                "page_size": len(chunk),
                "name": "^(" + "|".join(re.escape(name) for name in chunk) + ")$",
                "use_regex": "true",
            }
            try:
                response = await self._request("GET", path, "queue_list", params=params)
            except ManagementNotFound:
                return {}  # no such vhost: none of its queues exists
            body = self._json(response, path)
            items = _dicts(body.get("items")) if isinstance(body, dict) else []
            for item in items:
                info = QueueInfo.parse(item, vhost)
                if info.name in chunk:
                    found[info.name] = info
        return found

    async def delete_queue(
        self, vhost: str, name: str, *, if_empty: bool = False, if_unused: bool = False
    ) -> bool:
        """True when deleted, False when it did not exist.

        With `if_empty`/`if_unused` the broker checks atomically and answers 400
        (raised as ManagementBadRequest) when the queue holds messages or consumers.
        """
        params: dict[str, Any] = {}
        if if_empty:
            params["if-empty"] = "true"
        if if_unused:
            params["if-unused"] = "true"
        return await self._delete(f"/queues/{_q(vhost)}/{_q(name)}", "queue", **params)

    async def list_queues_page(
        self,
        vhost: str,
        *,
        page: int,
        page_size: int,
        columns: str = "name,arguments,durable,auto_delete,messages,consumers",
        name_prefix: str | None = None,
        sort: str | None = None,
    ) -> QueuePage:
        """One page of a vhost's queues.

        A page past the end (the vhost shrank between two calls) comes back empty
        with `page_count` one less, as the broker answers 400 for it.
        """
        params: dict[str, Any] = {
            "page": page,
            "page_size": page_size,
            "pagination": "true",
            **_queue_columns(columns),
        }
        if name_prefix:
            params["name"] = f"^{name_prefix}"
            params["use_regex"] = "true"
        if sort:
            params["sort"] = sort
        path = f"/queues/{_q(vhost)}"
        try:
            response = await self._request("GET", path, "queue_list", params=params)
        except ManagementNotFound:
            return QueuePage([], page, 0)
        except ManagementBadRequest as exc:
            if "out of range" not in exc.reason.lower():
                raise
            return QueuePage([], page, page - 1)
        body = self._json(response, path)
        if not isinstance(body, dict):
            raise BrokerUnavailable(f"Management API sent an unexpected body for {path}", path=path)
        items = [
            QueueInfo.parse(item, vhost)
            for item in _dicts(body.get("items"))
            if isinstance(item.get("name"), str)
        ]
        return QueuePage(items, page, int(body.get("page_count") or 0))

    # --- who consumes (presence, contract §11) -------------------------------------------
    async def list_consumers(self, vhost: str) -> list[ConsumerInfo]:
        """The vhost's consumers; the broker's statistics, a few seconds behind (the event
        exchange and a passive declare are not: broker/presence.py)."""
        path = f"/consumers/{_q(vhost)}"
        try:
            response = await self._request("GET", path, "consumer")
        except ManagementNotFound:
            return []
        return [ConsumerInfo.parse(item, vhost) for item in _dicts(self._json(response, path))]

    async def list_connections(self, vhost: str) -> list[ConnectionInfo]:
        path = f"/vhosts/{_q(vhost)}/connections"
        columns = "name,peer_host,peer_port,connected_at,client_properties,protocol"
        try:
            response = await self._request("GET", path, "connection", params={"columns": columns})
        except ManagementNotFound:
            return []
        return [ConnectionInfo.parse(item) for item in _dicts(self._json(response, path))]

    async def user_connections(self, user: str) -> list[ConnectionInfo]:
        """The connections logged in as `user` now, in any vhost, from the broker's connection
        tracking: exact the moment a connection opens or closes, unlike the statistics
        (`list_connections`), which lag the collection interval
        (docs/decisions/028-status-without-lag.md)."""
        path = f"/connections/username/{_q(user)}"
        try:
            response = await self._request("GET", path, "connection")
        except ManagementNotFound:
            return []
        return [ConnectionInfo.tracked(item) for item in _dicts(self._json(response, path))]

    async def queue_connections(
        self, vhost: str, readers: Mapping[str, str]
    ) -> dict[str, list[ConnectionInfo]]:
        """The connections reading each queue of `readers` (queue name -> the broker user its
        consumers log in as), oldest first.

        Exact from the connection tracking (`user_connections`): the user's open connections
        in `vhost`, without those the statistics say consume only other queues. The
        statistics, seconds behind, add when and with what client each came, and tell a
        user's connections to two queues apart once they have seen them
        (docs/decisions/028-status-without-lag.md)."""
        users = sorted(set(readers.values()))
        consumers, listed, tracked = await asyncio.gather(
            self.list_consumers(vhost),
            self.list_connections(vhost),
            asyncio.gather(*(self.user_connections(user) for user in users)),
        )
        details = {connection.name: connection for connection in listed}
        reading: dict[str, set[str]] = {}
        for consumer in consumers:
            reading.setdefault(consumer.connection_name, set()).add(consumer.queue)
        open_by_user = dict(zip(users, tracked, strict=True))
        oldest = datetime.max.replace(tzinfo=UTC)
        found: dict[str, list[ConnectionInfo]] = {}
        for queue, user in readers.items():
            mine = [
                connection.with_details(details.get(connection.name))
                for connection in open_by_user[user]
                if connection.vhost == vhost
                # Not yet seen consuming (new since the last collection), or seen on this queue.
                and queue in reading.get(connection.name, {queue})
            ]
            found[queue] = sorted(mine, key=lambda c: (c.connected_at or oldest, c.name))
        return found

    # --- connections and limits (revocation, quotas) --------------------------------------
    async def close_user_connections(self, user: str) -> bool:
        """Close every connection (AMQP, STOMP, Web-STOMP) logged in as `user`.

        True when the broker accepted the call (204, also when there were none).
        """
        return await self._delete(f"/connections/username/{_q(user)}", "connection")

    async def get_vhost_limits(self, vhost: str) -> dict[str, int]:
        return await self._limits(f"/vhost-limits/{_q(vhost)}", "vhost_limit")

    async def put_vhost_limit(self, vhost: str, name: str, value: int) -> None:
        await self._request(
            "PUT", f"/vhost-limits/{_q(vhost)}/{_q(name)}", "vhost_limit", json={"value": value}
        )

    async def get_user_limits(self, user: str) -> dict[str, int]:
        return await self._limits(f"/user-limits/{_q(user)}", "user_limit")

    async def put_user_limit(self, user: str, name: str, value: int) -> None:
        await self._request(
            "PUT", f"/user-limits/{_q(user)}/{_q(name)}", "user_limit", json={"value": value}
        )

    async def list_vhost_limits(self) -> dict[str, dict[str, int]]:
        """Every vhost's limits, in one call: {vhost: {limit: value}} (vhosts with none absent)."""
        return await self._all_limits("/vhost-limits", "vhost_limit", "vhost")

    async def list_user_limits(self) -> dict[str, dict[str, int]]:
        """Every user's limits, in one call: {user: {limit: value}} (users with none absent)."""
        return await self._all_limits("/user-limits", "user_limit", "user")

    async def _limits(self, path: str, kind: str) -> dict[str, int]:
        try:
            response = await self._request("GET", path, kind)
        except ManagementNotFound:
            return {}
        merged: dict[str, int] = {}
        for limits in _parse_limits(self._json(response, path), None).values():
            merged.update(limits)
        return merged

    async def _all_limits(self, path: str, kind: str, key: str) -> dict[str, dict[str, int]]:
        response = await self._request("GET", path, kind)
        return _parse_limits(self._json(response, path), key)


def _parse_limits(body: Any, key: str | None) -> dict[str, dict[str, int]]:
    """The broker answers `[{"vhost"|"user": name, "value": {limit: n}}, ...]`."""
    found: dict[str, dict[str, int]] = {}
    for entry in body if isinstance(body, list) else []:
        value = entry.get("value") if isinstance(entry, dict) else None
        if isinstance(value, dict):
            name = str(entry.get(key, "")) if key else ""
            found.setdefault(name, {}).update({str(k): int(v) for k, v in value.items()})
    return found
