"""Input no database can take, refused before any endpoint runs: a 400 naming the field.

PostgreSQL refuses a NUL character in text and `NaN`/`Infinity` in JSON; Python's JSON
parser accepts both (`"\\u0000"`, and the non-standard `NaN`, `Infinity`, `-Infinity`), so
without this check they reached the database and failed there. A lone UTF-16 surrogate
(`"\\ud800"`, or its bytes in a body's UTF-8) is no character at all: Python's parser lets
it through, PostgreSQL's `json` column stores it, and every answer that includes it then
fails to encode (a consumer's `payload_filters` once made its owner's list a 500 for good).

One application-wide dependency covers every query parameter and every JSON body, whatever
schema a route uses (the backend's accept routes, which run no dependency, call
`unstorable_body` themselves: events/endpoints.py); the body was already read and parsed by
FastAPI, so this costs one scan of the body per request unless it holds one of those tokens.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

from fastapi import Request

from queuekeeper.exceptions import BadRequest

NUL = "\x00"
# What a JSON body must hold for the walk below to find anything: a NUL or a surrogate as
# an escape (any case), a surrogate's bytes (`json.loads` decodes bytes with
# "surrogatepass", so they reach the parsed body too), NaN or Infinity. Each is looked for
# only past a one-byte search (memchr), which a body without it costs ~1 µs per 60 KB; a
# body in UTF-16 or UTF-32 is always walked.
_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_MESSAGE = (
    "holds a lone UTF-16 surrogate ({}), which is no character: send text as UTF-8, or "
    "escape a character beyond U+FFFF as a surrogate pair"
)


def _escaped(text: str) -> str:
    """`text` as it can be answered in JSON: a surrogate as its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _text_problem(text: str) -> str | None:
    if NUL in text:
        return "must not contain a NUL character (\\u0000)"
    found = _SURROGATE.search(text)
    if found is not None:
        return SURROGATE_MESSAGE.format(_escaped(found.group()))
    return None


# JSON nested deeper than this is refused: Python's parser, pydantic, the JSON encoder that
# stores a payload and this walk all recurse once per level, and a body nested a few
# hundred levels deep once got past the parser only to exhaust the stack further on.
MAX_JSON_DEPTH = 100


def _unstorable(document: Any) -> Iterator[tuple[str, str]]:
    """(path, what is wrong) for each bad value in a parsed JSON document; iterative, so a
    deep document costs no stack."""
    pending: list[tuple[Any, str, int]] = [(document, "", 0)]
    while pending:
        value, path, depth = pending.pop()
        if isinstance(value, str):
            problem = _text_problem(value)
            if problem is not None:
                yield path, problem
        elif isinstance(value, float):
            if not math.isfinite(value):
                yield path, f"must be a finite number, not {value!r}"
        elif depth >= MAX_JSON_DEPTH and isinstance(value, dict | list) and value:
            yield path, f"is nested deeper than {MAX_JSON_DEPTH} levels"
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                name = _escaped(str(key))
                child = f"{path}.{name}" if path else name
                problem = _text_problem(str(key))
                if problem is not None:
                    yield child, f"the key {problem}"
                children.append((item, child, depth + 1))
            pending.extend(reversed(children))
        elif isinstance(value, list):
            pending.extend(
                (item, f"{path}.{index}" if path else str(index), depth + 1)
                for index, item in reversed(list(enumerate(value)))
            )


def _suspect(body: bytes) -> bool:
    return (
        (b"\\" in body and _ESCAPE.search(body) is not None)
        or (b"\xed" in body and _SURROGATE_BYTES.search(body) is not None)
        or (b"N" in body and b"NaN" in body)
        or (b"I" in body and b"Infinity" in body)
        # No deeper than the brackets it holds (a count in C, ~20 µs per 60 KB).
        or body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
        or json.detect_encoding(body) != "utf-8"
    )


def unstorable_body(body: bytes) -> list[tuple[str, str]]:
    """Where a JSON body holds a NUL character, a lone surrogate or NaN/Infinity, or is
    nested too deeply: (field, what is wrong)."""
    if not _suspect(body):
        return []
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return []  # a malformed body is refused by whoever parses it, with its position
    return list(_unstorable(document))


def refuse(errors: list[tuple[str, str]]) -> None:
    if errors:
        field = errors[0][0]
        raise BadRequest(
            "; ".join(f"{field or 'body'}: {message}" for field, message in errors[:10]),
            field=field or "body",
            extra={"errors": [{"field": f or "body", "message": m} for f, m in errors[:10]]},
        )


async def reject_unstorable_input(request: Request) -> None:
    """FastAPI dependency: 400 for a NUL character in a query parameter or a JSON string, a
    lone surrogate in a JSON string or key, or NaN/Infinity anywhere in a JSON body."""
    errors: list[tuple[str, str]] = []
    for name, value in request.query_params.multi_items():
        if NUL in name or NUL in value:
            errors.append((name.replace(NUL, "\\u0000"), "must not contain a NUL character"))
    content_type = request.headers.get("content-type", "")
    if request.method in ("POST", "PUT", "PATCH") and "json" in content_type:
        errors.extend(unstorable_body(await request.body()))
    refuse(errors)
