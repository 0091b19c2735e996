"""The cluster scenario builds three RabbitMQ nodes and runs for minutes: only `make
test-cluster` (QK_CLUSTER=1) collects it, never `make test`."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("QK_CLUSTER") == "1" else ["test_*.py"]
