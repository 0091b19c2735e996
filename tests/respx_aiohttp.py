"""Teach respx the Management API client's transport.

respx intercepts httpx's own transport (httpcore) by default; `ManagementClient` sends
through httpx-aiohttp's `AiohttpTransport`, which takes and returns the same
`httpx.Request` and `httpx.Response`. respx has a mocker class per transport it patches and
none for this one, so this is it: the request is handed to the routes as it is, and a
route's response comes back as it is. Imported by conftest.py, which makes it the default,
so `respx.mock` in any test intercepts the Management API calls.
"""

from __future__ import annotations

from typing import Any

import httpx
from respx.mocks import AbstractRequestMocker


class AiohttpTransportMocker(AbstractRequestMocker):
    name = "httpx-aiohttp"
    targets = ["httpx_aiohttp.transport.AiohttpTransport"]
    target_methods = ["handle_async_request"]

    @classmethod
    def to_httpx_request(cls, **kwargs: Any) -> httpx.Request:
        request: httpx.Request = kwargs["request"]
        return request

    @classmethod
    async def from_async_httpx_response(
        cls, httpx_response: httpx.Response, target: Any, **kwargs: Any
    ) -> httpx.Response:
        return httpx_response
