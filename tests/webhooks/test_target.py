"""A webhook URL as the dispatcher posts to it (pure functions; nothing is connected to)."""

from __future__ import annotations

import base64

from queuekeeper.webhooks.dispatcher import Target, target


def test_a_credential_leaves_the_url_and_becomes_basic_authorization() -> None:
    parsed = target("https://hook:s%40cret@example.org/in?x=1")
    assert isinstance(parsed, Target)
    assert str(parsed.url) == "https://example.org/in?x=1"
    assert parsed.authorization == "Basic " + base64.b64encode(b"hook:s@cret").decode()
    assert parsed.destination == ("https", "example.org", 443)


def test_the_destination_is_the_host_as_resolved_with_its_port() -> None:
    parsed = target("http://münchen.example:8080/hook")
    assert isinstance(parsed, Target)
    assert parsed.destination == ("http", "xn--mnchen-3ya.example", 8080)
    assert parsed.authorization is None


def test_only_http_and_https_are_posted_to() -> None:
    assert target("ftp://example.org/") == "unsupported webhook URL scheme 'ftp'"
    assert isinstance(target("http://[2001:db8::1]/"), Target)
