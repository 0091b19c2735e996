"""Several broker nodes: the settings, the order nodes are tried in, and AMQP failover.

The dead and hanging nodes are TCP proxies in front of the one real broker: closed (refuses),
blackholed (accepts, never answers), and opened again (the node comes back).
"""

from __future__ import annotations

import errno
import time
import uuid

import pytest
from pydantic import ValidationError

from queuekeeper.broker.amqp import CONNECT_ERRORS, BrokerUnreachable, connect_vhost
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.nodes import NodeList
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.broker.publisher import AmqpPublisher, Outgoing, json_message
from queuekeeper.broker.verdict import Outcome
from queuekeeper.config import Settings
from tests.proxy import TcpProxy, free_port

QUEUE = "subscription_nodes_test"


def test_one_url_is_a_list_of_one_and_rabbit_url_is_honoured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QUEUEKEEPER_AMQP_URL", raising=False)
    monkeypatch.setenv("RABBIT_URL", "amqp://qk:pw@rabbit-a:5672/")
    settings = Settings()
    assert settings.amqp_url == "amqp://qk:pw@rabbit-a:5672/"
    assert settings.amqp_urls == ["amqp://qk:pw@rabbit-a:5672/"]
    assert settings.management_urls == ["http://127.0.0.1:15672"]

    monkeypatch.setenv("RABBIT_URL", "amqp://qk:pw@rabbit-a:5672/, amqp://qk:pw@rabbit-b:5672/,")
    monkeypatch.setenv("QUEUEKEEPER_MANAGEMENT_URL", "http://rabbit-a:15672/,http://rabbit-b:15672")
    settings = Settings()
    assert settings.amqp_urls == ["amqp://qk:pw@rabbit-a:5672/", "amqp://qk:pw@rabbit-b:5672/"]
    assert settings.management_urls == ["http://rabbit-a:15672", "http://rabbit-b:15672"]

    # QUEUEKEEPER_AMQP_URL wins over RABBIT_URL.
    monkeypatch.setenv("QUEUEKEEPER_AMQP_URL", "amqp://guest:guest@rabbit-c:5672/")
    assert Settings().amqp_urls == ["amqp://guest:guest@rabbit-c:5672/"]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("amqp_url", "amqp://a:5672/,http://b:15672", "amqp or amqps URL"),
        ("amqp_url", "amqp://a:5672/,amqps://b:5671/", "same scheme"),
        ("amqp_url", " , ", "at least one URL"),
        ("management_url", "rabbit-a:15672", "http or https URL"),
        ("queue_type", "stream", "classic"),
    ],
)
def test_bad_node_lists_are_refused_naming_the_field(field: str, value: str, says: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(**{field: value})
    assert caught.value.errors()[0]["loc"] == (field,)
    assert says in str(caught.value)


def test_a_failed_node_rests_behind_the_others_then_is_preferred_again() -> None:
    a, b, c = (f"amqp://guest:guest@rabbit-{n}:5672/" for n in "abc")
    now = [0.0]
    nodes = NodeList("amqp", [a, b, c], retry_seconds=10, clock=lambda: now[0])
    assert nodes.order() == [a, b, c]
    nodes.failed(a, "refused")
    assert nodes.order() == [b, c, a]
    assert nodes.preferred() == b
    now[0] = 5
    nodes.failed(b, "refused")
    # Every node failed: still all tried, the longest-failed first.
    nodes.failed(c, "refused")
    assert nodes.order() == [a, b, c]
    now[0] = 11  # a's window is over: it is tried in its configured place again
    nodes.answered(c)
    assert nodes.order() == [a, c, b]
    assert nodes.preferred() == c
    nodes.answered(a)
    assert nodes.preferred() == a
    assert nodes.down() == {"rabbit-b:5672": "refused"}


@pytest.fixture
def provisioner(settings: Settings, clean_state: None, management: ManagementClient) -> Provisioner:
    return Provisioner(management, settings, uuid.uuid4())


async def _vhost(provisioner: Provisioner) -> str:
    vhost = uuid.uuid4().hex
    await provisioner.ensure_vhost(vhost)
    await provisioner.ensure_queue(vhost, QUEUE)
    return vhost


def _publisher(settings: Settings, *nodes: TcpProxy, **changes: object) -> AmqpPublisher:
    urls = ",".join(node.amqp_url() for node in nodes)
    return AmqpPublisher(settings.model_copy(update={"amqp_url": urls, **changes}))


def _one(message_id: str) -> list[Outgoing]:
    return [json_message(QUEUE, b"{}", message_id=message_id, headers={})]


async def test_publisher_skips_a_closed_node_and_comes_back_to_it(
    settings: Settings, provisioner: Provisioner
) -> None:
    first, second = TcpProxy(port=free_port()), TcpProxy()
    second.start()  # `first` is not started: its port refuses connections
    publisher = _publisher(settings, first, second, broker_node_retry_seconds=0.3)
    vhosts = [await _vhost(provisioner) for _ in range(2)]
    try:
        results = await publisher.publish(vhosts[0], _one("while-first-down"))
        assert results[0].outcome is Outcome.CONFIRMED
        assert (first.accepted, second.accepted) == (0, 1)

        # The first node returns. Once its rest is over, a new connection goes to it...
        first.start()
        time.sleep(0.4)
        results = await publisher.publish(vhosts[1], _one("first-back"))
        assert results[0].outcome is Outcome.CONFIRMED
        assert (first.accepted, second.accepted) == (1, 1)
        # ...and the idle connection that failed over moves back to it at its next use.
        results = await publisher.publish(vhosts[0], _one("moved-back"))
        assert results[0].outcome is Outcome.CONFIRMED
        assert (first.accepted, second.accepted) == (2, 1)
    finally:
        await publisher.close()
        first.close()
        second.close()


async def test_a_node_that_never_answers_costs_one_connect_timeout_not_one_per_call(
    settings: Settings, provisioner: Provisioner
) -> None:
    hang, real = TcpProxy(blackhole=True), TcpProxy()
    hang.start()
    real.start()
    publisher = _publisher(settings, hang, real, amqp_connect_timeout=0.5)
    vhosts = [await _vhost(provisioner) for _ in range(3)]
    try:
        started = time.perf_counter()
        results = await publisher.publish(vhosts[0], _one("m-0"))
        assert results[0].outcome is Outcome.CONFIRMED
        assert 0.5 <= time.perf_counter() - started < 3
        started = time.perf_counter()
        for n, vhost in enumerate(vhosts[1:], 1):
            results = await publisher.publish(vhost, _one(f"m-{n}"))
            assert results[0].outcome is Outcome.CONFIRMED
        assert time.perf_counter() - started < 0.5 * len(vhosts[1:])
        assert (hang.accepted, real.accepted) == (1, 3)
    finally:
        await publisher.close()
        hang.close()
        real.close()


async def test_every_node_down_is_unreachable_and_the_publisher_recovers(
    settings: Settings, provisioner: Provisioner
) -> None:
    first, second = TcpProxy(port=free_port()), TcpProxy(port=free_port())
    publisher = _publisher(settings, first, second)
    vhost = await _vhost(provisioner)
    try:
        results = await publisher.publish(vhost, _one("all-down"))
        assert results[0].outcome is Outcome.UNREACHABLE
        second.start()
        results = await publisher.publish(vhost, _one("one-back"))
        assert results[0].outcome is Outcome.CONFIRMED
        assert second.accepted == 1
    finally:
        await publisher.close()
        first.close()
        second.close()


async def test_no_node_taking_the_connection_names_every_node_tried_and_what_it_said() -> None:
    """On uvloop (serve's loop) a refused connection says only "Connection refused": the
    error a caller reports (a copy's reason, a job's failure) names the nodes itself."""
    ports = [free_port(), free_port()]
    nodes = NodeList("amqp", [f"amqp://guest:guest@127.0.0.1:{p}/" for p in ports], 60)
    with pytest.raises(BrokerUnreachable) as caught:
        await connect_vhost(nodes, "/", connect_timeout=2, ssl_context=None)
    said = str(caught.value)
    for port in ports:
        assert f"127.0.0.1:{port}: " in said
    assert said.count(f"[Errno {errno.ECONNREFUSED}]") == 2
    assert isinstance(caught.value, CONNECT_ERRORS)  # every caller's handling still holds
    assert isinstance(caught.value.__cause__, CONNECT_ERRORS)
