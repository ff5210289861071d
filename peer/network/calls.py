"""Calls into this peer's DHT process over a Unix socket of its own, for the calls made many times a second.

hivemind's ``DHT.run_coroutine`` (and ``DHT.get``) sends each call through a pipe with an ``MPFuture``. Pickling the
future passes a file descriptor every time (multiprocessing's resource sharer: a new connection, an authentication
challenge, the descriptor sent over it) and a shared-memory tensor. Measured with py-spy in the demo's 100 s on 2
cores, after the stores and reads had been made few: that machinery (``rebuild_connection``,
``Connection._send``/``_recv``, ``SocketClient``, ``recvfds``) was about half of a rollout peer's DHT process's busy
samples, and the calling process pays its own side (docs/protocol.md "Calls into the DHT process").

:func:`serve` runs in the DHT process (started once with ``run_coroutine``) and listens on a Unix socket in the
swarm's private folder (mode 0700, ``tempfile.mkdtemp``): only this peer's own processes reach it. A
:class:`Channel` keeps one connection per thread and process; a call sends ``(function, args)`` pickled and
length-prefixed, the DHT process runs ``await function(*args, dht, node)`` exactly as ``run_coroutine`` would, and
sends back the result or the exception the same way. What travels is what hivemind's pipe carried already: pickles
between the processes of one peer, never anything from the network. Messages are framed as every stream of the
project is (:mod:`peer.network.framing`: a 4-byte big-endian length, then the bytes). A connection's calls run one
after another; the threads' connections run side by side on the DHT process's event loop.

A call whose DHT process is gone fails with :class:`ConnectionError` (hivemind's pipe would wait forever).
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from peer.network.framing import PREFIX_BYTES, length_prefix, read_length

TIMEOUT = 300.0  # s a call may take at most before its connection is given up (every call here is bounded far below)

_servers: list = []  # in the DHT process: the servers, kept referenced while the event loop runs


async def serve(path: str, _dht, node) -> str:
    """Runs inside the DHT process: answer the calls sent to the Unix socket at ``path``, from now until the
    process ends. Returns ``path``."""
    import asyncio

    from peer.network import request_counts

    counting = request_counts.folder()  # a benchmark's diagnostic (HIVEGRPO_COUNT_REQUESTS); None: off
    if counting is not None:
        request_counts.install(node, counting)

    async def handle(reader, writer) -> None:
        try:
            while True:
                function, args = pickle.loads(await reader.readexactly(await read_length(reader)))
                if counting is not None:
                    request_counts.tag_call(function)
                try:
                    answer = (True, await function(*args, _dht, node))
                except Exception as e:  # noqa: BLE001 - the caller gets the exception, as run_coroutine gives it
                    answer = (False, e)
                try:
                    data = pickle.dumps(answer)
                except Exception as e:  # noqa: BLE001 - an answer that does not pickle: say what it was
                    data = pickle.dumps((False, RuntimeError(f"the DHT process's answer did not pickle: {e!r}")))
                writer.write(length_prefix(len(data)) + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller's thread or process ended
        finally:
            writer.close()

    _servers.append(await asyncio.start_unix_server(handle, path=path))
    return path


class Channel:
    """The peer's side: ``call(function, *args)`` runs ``function(*args, dht, node)`` in the DHT process."""

    def __init__(self, path: str):
        self.path = path
        self._local = threading.local()

    def call(self, function: Callable[..., Awaitable[Any]], *args) -> Any:
        data = pickle.dumps((function, args))
        sock = None
        try:
            sock = self._connection()
            sock.sendall(length_prefix(len(data)) + data)
            ok, answer = pickle.loads(_receive(sock, int.from_bytes(_receive(sock, PREFIX_BYTES), "big")))
        except (OSError, EOFError) as e:  # gone, or stuck past TIMEOUT: the next call opens a new connection
            self._local.held = None
            if sock is not None:
                sock.close()
            raise ConnectionError(f"this peer's DHT process did not answer: {e}") from e
        if not ok:
            raise answer
        return answer

    def close(self) -> None:
        """Close this thread's connection (the others close with their threads' sockets)."""
        held, self._local.held = getattr(self._local, "held", None), None
        if held is not None and held[0] == os.getpid():
            held[1].close()

    def _connection(self) -> socket.socket:
        held = getattr(self._local, "held", None)
        if held is None or held[0] != os.getpid():  # a forked child opens its own, never shares its parent's
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(TIMEOUT)
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            held = self._local.held = (os.getpid(), sock)
        return held[1]


def _receive(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
