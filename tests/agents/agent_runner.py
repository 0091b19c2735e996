"""Runs the published waldur-site-agent's own event-processing set-up, under a time limit.

Executed with the python of the agent's virtualenv (tests/agents/site_agent_venv.py),
never imported by the suite. It loads the agent's YAML configuration with the
agent's own loader, then calls `start_stomp_consumers`, exactly as
`waldur_site_agent -m event_process` does after its (Waldur-marketplace only)
initial processing. The one thing replaced is the message-handling callback of
each object type: instead of acting on a backend, it appends what it received
(headers and body) to a JSON-lines file.

Usage: python agent_runner.py CONFIG RECORD STATUS [--setup-timeout S] [--lifetime S]

STATUS receives one JSON document once set-up returned (or timed out). The
runner then waits for a line "stop" on stdin (or end of input, or the lifetime),
shuts the consumers down with the agent's own `stop_stomp_consumers`, and exits.
The time limits matter: the agent retries a failing first STOMP connect forever.
"""

from __future__ import annotations

import argparse
import json
import os
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

    return on_message


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=Path)
    parser.add_argument("record", type=Path)
    parser.add_argument("status", type=Path)
    parser.add_argument("--setup-timeout", type=float, default=90.0)
    parser.add_argument("--lifetime", type=float, default=300.0)
    args = parser.parse_args()

    from waldur_site_agent.common import utils as common_utils
    from waldur_site_agent.event_processing import event_subscription_manager
    from waldur_site_agent.event_processing import utils as event_utils

    lock = threading.Lock()
    handlers = event_subscription_manager.OBJECT_TYPE_TO_HANDLER_STOMP
    for object_type in list(handlers):
        handlers[object_type] = _recorder(args.record, str(object_type.value), lock)

    configuration = common_utils.load_configuration(str(args.config), "event_process")
    imported = time.monotonic()
    result: dict[str, Any] = {}

    def set_up() -> None:
        try:
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
        {
            "object_type": subscription.observable_objects[0].object_type
            if subscription.observable_objects
            else None,
            "subscription": subscription.uuid.hex,
            "user_uuid": subscription.user_uuid.hex,
            "connected": connection.is_connected(),
        }
        for consumer_list in consumers_map.values()
        for connection, subscription, _offering in consumer_list
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
