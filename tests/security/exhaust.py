"""The body-exhaustion probe: concurrent huge POSTs against a real server while
`/healthz` is timed and the server's RSS is read from /proc.

Used by tests/security/test_serve_exhaustion.py; also runnable against any server:
`python -m tests.security.exhaust http://127.0.0.1:8000 <pid>` prints the figures.
"""

from __future__ import annotations

import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

MiB = 1024 * 1024
CHUNK = b" " * MiB


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def post_huge(
    base: str, path: str, size: int, headers: dict[str, str], *, chunked: bool = False
) -> int:
    """Send up to `size` bytes of body, stopping as soon as the server answers; its status."""
    url = urlsplit(base)
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=60)
    lines = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    sent = 0
    answer = b""
    try:
        while True:
            readable, writable, _ = select.select([sock], [sock] if sent < size else [], [], 30)
            if readable:
                answer = sock.recv(65536)
                break
            if writable:
                piece = CHUNK[: min(len(CHUNK), size - sent)]
                frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
                sock.sendall(frame)
                sent += len(piece)
                if chunked and sent >= size:
                    sock.sendall(b"0\r\n\r\n")
            if not readable and not writable:
                break
    except OSError:
        pass
    finally:
        sock.close()
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


@dataclass
class Figures:
    rss_before: float
    rss_peak: float
    healthz_worst: float
    statuses: list[int] = field(default_factory=list)

    @property
    def growth(self) -> float:
        return self.rss_peak - self.rss_before

    def __str__(self) -> str:
        return (
            f"RSS {self.rss_before:.0f} -> peak {self.rss_peak:.0f} MiB "
            f"(+{self.growth:.0f}); slowest /healthz {self.healthz_worst * 1000:.0f} ms; "
            f"answers {self.statuses}"
        )


def attack(
    base: str,
    pid: int,
    *,
    path: str = "/api/event-subscriptions/",
    headers: dict[str, str] | None = None,
    requests: int = 4,
    size: int = 63 * MiB,
    chunked: bool = False,
) -> Figures:
    figures = Figures(rss_mib(pid), rss_mib(pid), 0.0)
    statuses: list[int] = []

    def one() -> None:
        statuses.append(post_huge(base, path, size, headers or {}, chunked=chunked))

    threads = [threading.Thread(target=one) for _ in range(requests)]
    for thread in threads:
        thread.start()
    with httpx.Client(base_url=base, timeout=30) as probe:
        while True:  # at least once, however fast the attack is refused
            started = time.perf_counter()
            assert probe.get("/healthz").status_code == 200
            figures.healthz_worst = max(figures.healthz_worst, time.perf_counter() - started)
            figures.rss_peak = max(figures.rss_peak, rss_mib(pid))
            if not any(thread.is_alive() for thread in threads):
                break
            time.sleep(0.02)
    for thread in threads:
        thread.join()
    figures.rss_peak = max(figures.rss_peak, rss_mib(pid))
    figures.statuses = sorted(statuses)
    return figures


if __name__ == "__main__":
    print(attack(sys.argv[1], int(sys.argv[2])))
