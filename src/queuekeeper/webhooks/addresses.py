"""Where a webhook may point (contract §13): the rule as a pure function of an address, and
the resolution that applies it.

A URL is checked at registration and again at every attempt, on the addresses its host
resolves to at that moment; the attempt then connects to the address checked, never
resolving again (a name that resolves to a public address for the check and a private one
for the connection gets nowhere). Every address a name resolves to must pass: a name that
mixes public and private answers is refused, so the resolver's order cannot decide.
The standard library's `ipaddress` holds the registries (IANA special-purpose blocks);
only the order of the reasons is ours, and the IPv6 blocks that carry an IPv4 address
(6to4, Teredo, NAT64), which are judged as the address they carry: the registry calls
some of them global, so `2002:7f00:1::` (6to4 of 127.0.0.1) would otherwise pass.
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


# IPv6 blocks that carry an IPv4 address a relay or translator connects to.
_NAT64_WELL_KNOWN = IPv6Network("64:ff9b::/96")  # RFC 6052: the address in the last 32 bits
_NAT64_LOCAL = IPv6Network("64:ff9b:1::/48")  # RFC 8215: the operator picks the length
# RFC 6052 section 2.2: where a prefix of each length puts the IPv4 address's 32 bits;
# bits 64-71 (the "u" octet) are never part of it. Within the local-use /48 the operator
# may use a /48, /56, /64 or /96 prefix, and which one cannot be told from the address:
# each must pass (the /96, the usual one, is named first).
_NAT64_LENGTHS = (96, 64, 56, 48)
# Deprecated (RFC 3879) but routable where it is still configured: a private block.
_SITE_LOCAL = IPv6Network("fec0::/10")


class AddressRefused(Exception):
    """A webhook URL's host may not be reached; `reason` says why, for people."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _nat64_embedded(address: IPv6Address, length: int) -> IPv4Address:
    """The IPv4 address a NAT64 prefix of `length` bits puts in `address` (RFC 6052)."""
    packed = address.packed
    octets = (packed[:8] + packed[9:])[length // 8 : length // 8 + 4]  # without the u octet
    if length == 96:
        octets = packed[12:16]
    return IPv4Address(octets)


def embedded(address: IPv6Address) -> list[tuple[str, IPv4Address]]:
    """The IPv4 addresses an IPv6 address carries, each with its mechanism: the one a
    6to4 relay, a Teredo relay (the client address, obfuscated by xor 0xffffffff) or a
    NAT64 translator would connect to. Several for the local-use NAT64 block (each prefix
    length it may be used with); none for any other address."""
    if address.sixtofour is not None:
        return [("6to4", address.sixtofour)]
    if address.teredo is not None:
        return [("Teredo", address.teredo[1])]
    if address in _NAT64_WELL_KNOWN:
        return [("NAT64", _nat64_embedded(address, 96))]
    if address in _NAT64_LOCAL:
        return [("NAT64", _nat64_embedded(address, length)) for length in _NAT64_LENGTHS]
    return []


def refusal(address: IPAddress, allowed: Sequence[IPNetwork] = ()) -> str | None:
    """Why a webhook may not connect to `address` (None: it may). An address inside an
    allowed network passes whatever it is; an IPv4 address written as IPv6 is judged as the
    IPv4 address it is, and one carried by 6to4, Teredo or NAT64 as that address (every
    address it may carry must pass)."""
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address.version == network.version and address in network for network in allowed):
        return None
    if isinstance(address, IPv6Address):
        carried = embedded(address)
        for mechanism, inner in carried:
            reason = refusal(inner, allowed)
            if reason is not None:
                return f"{address} carries {inner} ({mechanism}): {reason}"
        if carried:
            return None
        if address in _SITE_LOCAL:
            return f"{address} is a private address (site-local)"
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
