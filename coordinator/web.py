"""The coordinator's live web page: the swarm's status over time, a JSON API and Prometheus metrics.

:class:`StatusHistory` reads :func:`peer.status.read_status` every ``interval`` seconds (the same data as
``hivegrpo status``) and keeps a bounded series of points. :class:`WebServer` serves, from a thread of the host:

====================  ==================================================================================
``/``                 the page: peers table, reward (and exact match, when the host evaluates) against
                      time, adapter version against time, groups/s per rollout peer; it polls the API
``/api/status``       the newest status, as ``hivegrpo status --json`` prints it
``/api/history``      ``{"points": [...], "evaluations": [...]}``, oldest first: status points (time, version,
                      reward, staleness, rates per peer) and the host's exact-match measurements
``/metrics``          Prometheus text format (gauges and counters of the newest status)
====================  ==================================================================================

The page is one self-contained HTML file (no CDN, no build step): a host on a closed network serves it whole.

The server is on the open internet as soon as ``--web-host 0.0.0.0`` says so, so it bounds what a client can hold:
a connection silent for ``REQUEST_TIMEOUT`` seconds is closed (a slow client cannot keep threads for ever), and at
most ``MAX_CLIENTS`` are served at once (others are closed unanswered). Bound to a loopback address (the default),
it answers only requests whose ``Host`` names a loopback address: a web page elsewhere that rebinds its own domain
name to 127.0.0.1 cannot read the swarm's status (peer addresses, names, a private run's members) through the
user's browser.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from typing import Any

from coordinator.metrics import charted, prometheus
from peer.log import get_logger
from peer.status import LIVE

logger = get_logger(__name__)

HISTORY_POINTS = 4320  # 6 h at the default 5 s


class StatusHistory:
    """Reads the status every ``interval`` seconds on a thread; keeps the newest and a bounded series."""

    def __init__(self, read: Callable[[], dict], interval: float = 5.0, points: int = HISTORY_POINTS):
        self.read = read
        self.interval = interval
        self.points: deque[dict] = deque(maxlen=points)
        self.latest: dict | None = None
        self.evaluations: deque[dict] = deque(maxlen=points)  # the host's exact-match measurements, if it makes any
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-history", daemon=True)

    def start(self) -> StatusHistory:
        self._thread.start()
        return self

    def poll(self) -> dict:
        status = self.read()
        point = point_of(status)
        with self._lock:
            self.latest = status
            self.points.append(point)
        return status

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as e:  # the network boundary: the page shows the last good reading meanwhile
                logger.warning("could not read the swarm's status: %s", e)
            self._stop.wait(self.interval)

    def record_eval(self, version: int, exact_match: float) -> None:
        with self._lock:
            self.evaluations.append({"time": time.time(), "adapter_version": version, "exact_match": exact_match})

    @property
    def exact_match(self) -> dict | None:
        """The newest evaluation (``time``, ``adapter_version``, ``exact_match``), or None."""
        with self._lock:
            return self.evaluations[-1] if self.evaluations else None

    def history(self) -> list[dict]:
        with self._lock:
            return list(self.points)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 30)


def point_of(status: dict) -> dict:
    """One point of the series: what the page plots from one status reading."""
    return {
        "time": status["time"],
        "adapter_version": status["adapter_version"],
        "reward_mean": status["reward_mean"],
        "staleness_mean": status["staleness_mean"],
        "groups_accepted": status["groups_accepted"],
        "groups_rejected": status["groups_rejected"],
        "peers": sum(status["roles"].values()),
        "rates": {
            p["peer_id"]: round(p["groups_per_s"], 4)
            for p in charted([p for p in status["peers"] if p["state"] in LIVE])
            if p["role"] == "rollout" and p["groups_per_s"] is not None
        },
    }


def page() -> bytes:
    return files("coordinator").joinpath("web_page.html").read_bytes()


REQUEST_TIMEOUT = 10.0  # s a client may stay silent (while sending its request, or not reading the answer)
MAX_CLIENTS = 32  # connections served at once
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host in LOOPBACK_NAMES or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8080`` -> ``[::1]``)."""
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, handler, max_clients: int = MAX_CLIENTS):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_clients)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed unanswered
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class WebServer:
    """Serves the page, the JSON API and ``/metrics`` on ``(host, port)`` (port 0: any free one) from a thread."""

    def __init__(
        self,
        history: StatusHistory,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout: float = REQUEST_TIMEOUT,
        max_clients: int = MAX_CLIENTS,
    ):
        self.history = history
        self.loopback_only = is_loopback(host)
        handler = type("Handler", (_Handler,), {"server_state": self, "timeout": timeout})
        self.httpd = _Server((host, port), handler, max_clients)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="web", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> WebServer:
        self._thread.start()
        logger.info("status page at %s", self.url)
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    server_state: WebServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        logger.debug("web: " + format, *args)

    def _send(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, value: Any, code: int = 200) -> None:
        self._send(code, json.dumps(value).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        named = host_name(self.headers.get("Host", ""))
        if self.server_state.loopback_only and not is_loopback(named):
            self._json({"error": f"this page answers only on localhost, not {named[:64]!r}"}, 421)
            return
        history = self.server_state.history
        path = self.path.split("?", 1)[0]
        latest = history.latest
        if path in ("/", "/index.html"):
            self._send(200, page(), "text/html; charset=utf-8")
        elif path == "/api/history":
            self._json({"points": history.history(), "evaluations": list(history.evaluations), "now": time.time()})
        elif path in ("/api/status", "/metrics") and latest is None:
            self._json({"error": "no status read yet; try again in a few seconds"}, 503)
        elif path == "/api/status":
            self._json(latest | {"exact_match": history.exact_match})
        elif path == "/metrics":
            em = history.exact_match
            text = prometheus(latest, None if em is None else em["exact_match"])
            self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._json({"error": f"no page {path}; try /, /api/status, /api/history or /metrics"}, 404)


__all__ = ["MAX_CLIENTS", "REQUEST_TIMEOUT", "StatusHistory", "WebServer", "point_of", "prometheus"]
