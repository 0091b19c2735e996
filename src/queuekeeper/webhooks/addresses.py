"""Where a webhook may point (contract §13): the rule as a pure function of an address, and
the resolution that applies it.

A URL is checked at registration and again at every attempt, on the addresses its host
resolves to at that moment; the attempt then connects to the address checked, never
resolving again (a name that resolves to a public address for the check and a private one
for the connection gets nowhere). Every address a name resolves to must pass: a name that
mixes public and private answers is refused, so the resolver's order cannot decide.
The standard library's `ipaddress` holds the registries (IANA special-purpose blocks);
only the order of the reasons is ours.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

# Checked in this order; the first that holds is the reason given.
_KINDS = (
    ("is_unspecified", "unspecified"),
    ("is_loopback", "loopback"),
    ("is_link_local", "link-local"),
    ("is_multicast", "multicast"),
    ("is_private", "private"),
    ("is_reserved", "reserved"),
)


class AddressRefused(Exception):
    """A webhook URL's host may not be reached; `reason` says why, for people."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def refusal(address: IPAddress, allowed: Sequence[IPNetwork] = ()) -> str | None:
    """Why a webhook may not connect to `address` (None: it may). An address inside an
    allowed network passes whatever it is; an IPv4 address written as IPv6 is judged as the
    IPv4 address it is."""
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address.version == network.version and address in network for network in allowed):
        return None
    for attribute, kind in _KINDS:
        if getattr(address, attribute):
            article = "an" if kind[0] in "aeiou" else "a"
            return f"{address} is {article} {kind} address"
    if not address.is_global:
        return f"{address} is not a public address"
    return None


@dataclass(frozen=True)
class Resolved:
    """The address to connect to, checked, for one attempt."""

    host: str
    address: str
    port: int


async def resolve(host: str, port: int, allowed: Sequence[IPNetwork] = ()) -> Resolved:
    """The address `host` resolves to now, if every address it resolves to may be reached;
    else AddressRefused naming the first that may not, or that it does not resolve."""
    try:
        literal: IPAddress | None = ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        found = [literal]
    elif host.rstrip(".").lower().split(".")[-1] == "invalid":
        # RFC 6761: a name under `.invalid` never resolves; no resolver is asked.
        raise AddressRefused(f"{host} does not resolve (a name under .invalid never does)")
    else:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise AddressRefused(f"{host} does not resolve ({exc})") from exc
        found = [ip_address(info[4][0]) for info in infos]
        if not found:
            raise AddressRefused(f"{host} does not resolve")
    for address in found:
        reason = refusal(address, allowed)
        if reason is not None:
            raise AddressRefused(reason if literal is not None else f"{host} resolves to {reason}")
    return Resolved(host=host, address=str(found[0]), port=port)
