"""Where a webhook may point (contract §13) as pure functions: the address rule, a URL's
form and what an answer shows of it. Nothing here resolves a name or connects anywhere."""

from __future__ import annotations

import asyncio
from ipaddress import ip_address, ip_network

import pytest

from queuekeeper.common.urls import destination
from queuekeeper.exceptions import BadRequest
from queuekeeper.webhooks.addresses import AddressRefused, refusal, resolve
from queuekeeper.webhooks.urls import MAX_URL_LENGTH, new_secret, parsed


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("240.0.0.1", "240.0.0.1 is"),  # reserved (the registry also calls it private)
        ("100.64.0.1", "not a public address"),  # carrier-grade NAT
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("::ffff:10.0.0.1", "private"),  # IPv4 written as IPv6
    ],
)
def test_special_addresses_are_refused(address: str, kind: str) -> None:
    reason = refusal(ip_address(address))
    assert reason is not None
    assert kind in reason


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"])
def test_public_addresses_pass(address: str) -> None:
    assert refusal(ip_address(address)) is None


def test_allowed_networks_let_their_addresses_through_and_no_others() -> None:
    allowed = [ip_network("10.0.5.0/24")]
    assert refusal(ip_address("10.0.5.7"), allowed) is None
    assert refusal(ip_address("10.0.6.7"), allowed) is not None


@pytest.mark.parametrize(
    ("address", "carried", "kind"),
    [
        ("2002:7f00:1::", "127.0.0.1", "loopback"),  # 6to4
        ("2002:a00:1::1", "10.0.0.1", "private"),
        ("2002:a9fe:a9fe::", "169.254.169.254", "link-local"),
        # Teredo: the client address is the last 32 bits xor 0xffffffff.
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "127.0.0.1", "loopback"),
        ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "10.0.0.1", "private"),
        ("64:ff9b::7f00:1", "127.0.0.1", "loopback"),  # NAT64, well-known prefix
        ("64:ff9b::a9fe:a9fe", "169.254.169.254", "link-local"),
        ("64:ff9b:1::a00:1", "10.0.0.1", "private"),  # local-use, as a /96
        # Local-use as a /64: 127.0.0.8 in bits 72-103, though a /96 would read 8.8.8.8.
        ("64:ff9b:1:0:7f:0:808:808", "127.0.0.8", "loopback"),
    ],
)
def test_an_address_carried_by_6to4_teredo_or_nat64_is_judged_as_itself(
    address: str, carried: str, kind: str
) -> None:
    reason = refusal(ip_address(address))
    assert reason is not None
    assert carried in reason, reason
    assert kind in reason, reason


def test_an_allowed_network_lets_an_address_it_carries_through() -> None:
    allowed = [ip_network("10.0.0.0/24")]
    for address in ["2002:a00:1::1", "64:ff9b::a00:1", "2001:0:4136:e378:8000:63bf:f5ff:fffe"]:
        assert refusal(ip_address(address), allowed) is None, address
    assert refusal(ip_address("64:ff9b::a00:101"), allowed) is not None  # 10.0.1.1


@pytest.mark.parametrize(
    "address",
    [
        "2002:808:808::1",  # 6to4 of 8.8.8.8
        "2001:0:4136:e378:8000:63bf:f7f7:f7f7",  # Teredo, client 8.8.8.8
        "64:ff9b::808:808",  # NAT64 of 8.8.8.8
        "64:ff9b:1:808:8:808:808:808",  # local-use: 8.8.8.8 at every prefix length
    ],
)
def test_an_address_carrying_a_public_address_passes(address: str) -> None:
    assert refusal(ip_address(address)) is None


@pytest.mark.parametrize("address", ["fec0::1", "feff:ffff::1"])
def test_site_local_addresses_are_refused_as_private(address: str) -> None:
    reason = refusal(ip_address(address))
    assert reason is not None
    assert "private" in reason, reason


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://hooks.example.org/", "must be an http or https URL"),
        ("hooks.example.org/x", "must be an http or https URL"),
        ("https://hooks.example.org/" + "a" * MAX_URL_LENGTH, "longer than 2048"),
        ("https://hooks.example.org/x#frag", "has a fragment"),
        ("https:///x", "has no host"),
        ("https://hooks.example.org:0/", "port 0"),
        ("https://hooks.example.org/a b", "whitespace"),
        ("https://hooks.example.org/a\x7fb", "not a valid URL"),  # nothing could post it
    ],
)
def test_malformed_urls_are_refused_naming_the_field(url: str, reason: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parsed(url)
    assert refused.value.field == "webhook_url"
    assert reason in str(refused.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://user:pass@hooks.example.org/p?key=secret", "https://hooks.example.org"),
        ("HTTPS://Hooks.Example.org:443/p", "https://hooks.example.org"),
        ("http://hooks.example.org:8080/p", "http://hooks.example.org:8080"),
        ("http://[2001:db8::1]:9/p", "http://[2001:db8::1]:9"),
    ],
)
def test_the_destination_is_scheme_host_and_port_only(url: str, shown: str) -> None:
    assert destination(url) == shown


def test_secrets_are_standard_webhooks_secrets() -> None:
    first, second = new_secret(), new_secret()
    assert first.startswith("whsec_")
    assert first != second


async def test_a_name_under_invalid_is_refused_without_asking_a_resolver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RFC 6761: such a name never resolves; the tests' unresolvable URLs rely on it to send
    nothing to the machine's resolver (not on loopback)."""

    async def no_lookup(*_args: object, **_kwargs: object) -> list[object]:
        raise AssertionError("a resolver was asked")

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "getaddrinfo", no_lookup)
    with pytest.raises(AddressRefused, match="does not resolve"):
        await resolve("hooks.example.invalid", 443)
