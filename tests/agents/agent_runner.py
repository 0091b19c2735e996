"""Runs the published waldur-site-agent's own event-processing set-up, under a time limit.

Executed with the python of the agent's virtualenv (tests/agents/site_agent_venv.py),
never imported by the suite; it works with 1.0.5 (a connection per object type) and
1.0.7 (one unified queue per offering, routed by the body's `object_type`). It loads
the agent's YAML configuration with the agent's own loader, then calls
`start_stomp_consumers`, exactly as `waldur_site_agent -m event_process` does; with
`--initial-processing` it first runs the agent's initial offering processing as that
command does (identity registration, then `register_service`, which queuekeeper
answers 404 and the agent logs). The one thing replaced is the message handler of
each object type: instead of acting on a backend, it appends what it received
(headers and body) to a JSON-lines file. In 1.0.7 the agent's own router
(`route_message`) still picks the handler from the body.

Usage: python agent_runner.py CONFIG RECORD STATUS [--setup-timeout S] [--lifetime S]
       [--initial-processing] [--project-groups] [--resolve NAME:ADDRESS]

`--resolve` (as curl's) makes NAME resolve to ADDRESS in this process only, for a test that
serves a host name on a loopback address without editing /etc/hosts: the agent still dials
the name its configuration gives, sends it in the TLS handshake and checks the certificate
against it; only the address lookup is answered here (decision 024).

`--project-groups` (1.0.8 and later) answers the agent's question "does the username
backend write project groups?" with yes, as a directory plugin (LDAP, say) would, so the
agent subscribes to `service_provider_project_group`; no such plugin is installed here.

A recorded body carrying `"e2e_hold": true` that is not a redelivery keeps its handler
running until the file RECORD.release exists (at most two minutes): with 1.0.8's
`client-individual` acks the message stays unacknowledged meanwhile, which the ack-mode
test observes on the broker.

STATUS receives one JSON document once set-up returned (or timed out). The
runner then waits for a line "stop" on stdin (or end of input, or the lifetime),
shuts the consumers down with the agent's own `stop_stomp_consumers`, and exits.
The time limits matter: the agent retries a failing first STOMP connect forever.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

STARTED = time.monotonic()


def _write_json(path: Path, document: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(document))
    partial.replace(path)  # the test never reads half a document


HOLD_LIMIT = 120.0


def _holds(body: str) -> bool:
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("e2e_hold") is True


def _recorder(record: Path, object_type: str, lock: threading.Lock) -> Any:
    def on_message(frame: Any, offering: Any, user_agent: str, *_args: Any) -> None:
        line = json.dumps(
            {
                "object_type": object_type,
                "headers": dict(frame.headers),
                "body": frame.body,
                "offering_uuid": offering.uuid,
                "user_agent": user_agent,
            }
        )
        with lock, record.open("a", encoding="utf-8") as stream:
            stream.write(line + "\n")
        if frame.headers.get("redelivered") != "true" and _holds(frame.body):
            release = record.with_suffix(".release")
            deadline = time.monotonic() + HOLD_LIMIT
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    return on_message


def _resolve(names: dict[str, str]) -> None:
    """Answer the address lookup of these names (socket.create_connection, httpx and
    websocket-client all look up through socket.getaddrinfo)."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        return real(names.get(host, host) if isinstance(host, str) else host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo


def _describe(connection: Any, registered: Any) -> dict[str, Any]:
    if hasattr(registered, "queue_name"):  # 1.0.7: the register_queue answer
        return {
            "queue_name": registered.queue_name,
            "rmq_username": registered.rmq_username,
            "vhost": registered.vhost,
            "observable_object_types": list(registered.observable_object_types),
            "agent_identity_uuid": registered.agent_identity_uuid,
            "connected": connection.is_connected(),
        }
    return {  # 1.0.5: one event subscription per object type
        "object_type": registered.observable_objects[0].object_type
        if registered.observable_objects
        else None,
        "subscription": registered.uuid.hex,
        "user_uuid": registered.user_uuid.hex,
        "connected": connection.is_connected(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=Path)
    parser.add_argument("record", type=Path)
    parser.add_argument("status", type=Path)
    parser.add_argument("--setup-timeout", type=float, default=90.0)
    parser.add_argument("--lifetime", type=float, default=300.0)
    parser.add_argument("--initial-processing", action="store_true")
    parser.add_argument("--project-groups", action="store_true")
    parser.add_argument("--resolve", action="append", default=[], metavar="NAME:ADDRESS")
    args = parser.parse_args()
    _resolve(dict(item.split(":", 1) for item in args.resolve))

    from waldur_site_agent.common import utils as common_utils
    from waldur_site_agent.event_processing import event_subscription_manager
    from waldur_site_agent.event_processing import utils as event_utils

    lock = threading.Lock()
    handlers = event_subscription_manager.OBJECT_TYPE_TO_HANDLER_STOMP
    for object_type in list(handlers):
        handlers[object_type] = _recorder(args.record, str(object_type.value), lock)

    if args.project_groups:
        event_utils._username_backend_reconciles_project_groups = lambda _offering: True

    configuration = common_utils.load_configuration(str(args.config), "event_process")
    imported = time.monotonic()
    result: dict[str, Any] = {}

    def set_up() -> None:
        try:
            if args.initial_processing:
                event_utils.run_initial_offering_processing(
                    configuration.waldur_offerings,
                    configuration.waldur_user_agent,
                    expose_backend_error_details=configuration.expose_backend_error_details,
                )
            result["map"] = event_utils.start_stomp_consumers(
                configuration.waldur_offerings,
                configuration.waldur_user_agent,
                expose_backend_error_details=configuration.expose_backend_error_details,
            )
        except BaseException as exc:  # reported to the test, which fails with it
            result["error"] = repr(exc)
        result["finished"] = time.monotonic()

    thread = threading.Thread(target=set_up, name="agent-set-up", daemon=True)
    thread.start()
    thread.join(args.setup_timeout)
    if thread.is_alive():
        _write_json(args.status, {"event": "timeout", "setup_timeout": args.setup_timeout})
        os._exit(3)
    if "error" in result:
        _write_json(args.status, {"event": "error", "error": result["error"]})
        os._exit(4)

    consumers_map = result["map"]
    consumers = [
        _describe(connection, registered)
        for consumer_list in consumers_map.values()
        for connection, registered, _offering in consumer_list
    ]
    _write_json(
        args.status,
        {
            "event": "ready",
            "consumers": consumers,
            "import_seconds": imported - STARTED,
            "setup_seconds": result["finished"] - imported,
            "total_seconds": result["finished"] - STARTED,
        },
    )

    stop = threading.Event()

    def wait_for_stop() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    stop.wait(args.lifetime)
    event_utils.stop_stomp_consumers(consumers_map)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
