"""structlog set-up: JSON in production, readable in a terminal, one format for every library.

uvicorn, SQLAlchemy, aio-pika/aiormq, APScheduler and httpx log through the standard
library; their records go through the same processors as queuekeeper's own, so every
line has a timestamp, a level, the logger's name and, inside a request, its
`request_id`. Secrets are masked last, after tracebacks have been turned into text, so a
token cannot slip out through an exception message either.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import IO, Any

import structlog

from queuekeeper.common.redact import Redactor, url_password
from queuekeeper.config import Settings

# Libraries whose INFO lines are one per call (httpx: one per Management API request;
# APScheduler: "Running job" and "executed successfully" for every run, two lines every
# 10 s when idle); they speak at WARNING unless the root level is DEBUG.
_CHATTY = ("httpx", "httpcore", "aiormq", "asyncio", "apscheduler")
_BRIDGED = (
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
    "sqlalchemy",
    "aio_pika",
    "aiormq",
    "apscheduler",
    "alembic",
    "httpx",
)

redactor = Redactor()


def _mask_secrets(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key, value in list(event_dict.items()):
        event_dict[key] = redactor.value(value, key)
    return event_dict


# Record attributes ExtraAdder would copy that only repeat `event`: uvicorn's coloured
# copy of its message, and what another handler's formatter leaves on the record.
_NOT_EXTRA = ("color_message", "message", "asctime")


def _drop_non_extras(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key in _NOT_EXTRA:
        event_dict.pop(key, None)
    return event_dict


def known_secrets(settings: Settings) -> list[str]:
    secrets = [settings.management_password, *settings.service_tokens]
    for url in (*settings.amqp_urls, *settings.management_urls, settings.database_url):
        password = url_password(url)
        if password:
            secrets.append(password)
    return secrets


def _use_json(log_format: str, stream: IO[str]) -> bool:
    if log_format == "json":
        return True
    if log_format == "console":
        return False
    return not (hasattr(stream, "isatty") and stream.isatty())


class QueuekeeperHandler(logging.StreamHandler[IO[str]]):
    """Marks the handler as ours, so configuring again replaces it and nothing else."""


def configure_logging(
    settings: Settings | None = None,
    *,
    level: str | None = None,
    log_format: str | None = None,
    stream: IO[str] | None = None,
) -> None:
    """Idempotent. Other handlers on the root logger (e.g. pytest's) are left alone."""
    level = (level or (settings.log_level if settings else "INFO")).upper()
    log_format = log_format or (settings.log_format if settings else "auto")
    stream = stream or sys.stderr
    if settings is not None:
        redactor.add_known(known_secrets(settings))

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        _drop_non_extras,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if _use_json(log_format, stream)
        else structlog.dev.ConsoleRenderer(colors=hasattr(stream, "isatty") and stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.PositionalArgumentsFormatter(),
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a module logger first used before this call must still pick up
        # this configuration (and a later one, e.g. in tests).
        cache_logger_on_first_use=False,
    )
    handler = QueuekeeperHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _mask_secrets,
                renderer,
            ],
        )
    )
    # The standard library's own optimisations (its docs, "Optimization"): no line shows
    # the caller, thread or process, and finding them costs every line, the access line of
    # each single event among them.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, QueuekeeperHandler)]
    root.addHandler(handler)
    root.setLevel(level)
    # Libraries that install their own handlers (uvicorn) would print twice or in their
    # own format: route them through the root handler instead.
    for name in _BRIDGED:
        library = logging.getLogger(name)
        library.handlers[:] = []
        library.propagate = True
        library.setLevel(logging.NOTSET)
    debugging = level == "DEBUG"
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.DEBUG if debugging else logging.WARNING)
    # SQLAlchemy: SQL statements (parameters hidden by the engine) only when debugging;
    # never result rows (DEBUG: they hold password hashes) nor its mapper set-up chatter.
    logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
    logging.getLogger("sqlalchemy.engine").setLevel(logging.INFO if debugging else logging.WARNING)
    # uvicorn's access line is replaced by queuekeeper's `http_request` line, which carries
    # the request id and the route template.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # stomp.py logs the passcode in clear at DEBUG; never let it reach DEBUG.
    logging.getLogger("stomp").setLevel(max(logging.INFO, root.level))
