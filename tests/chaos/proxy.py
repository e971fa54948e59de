"""A TCP proxy that breaks the network between oncely's processes and the broker (S7).

Stdlib only: an asyncio loop on a daemon thread. The listening socket is bound when the proxy
is made, so the broker can advertise its address (``KafkaNode(proxied_by=proxy.address)``)
before the proxy knows where to forward; :meth:`FaultyProxy.start` then names the upstream.

Faults, switched from the test's thread at any time (each switch runs on the proxy's loop):

- :meth:`~FaultyProxy.add_latency`: every chunk is forwarded ``delay`` seconds (plus up to
  ``jitter``) after it was read, in order, both ways: a long link, not a narrow one.
- :meth:`~FaultyProxy.reset`: every live connection is closed with a TCP RST (``SO_LINGER`` 0),
  and for ``refuse_seconds`` new connections are reset as soon as they are accepted.
- :meth:`~FaultyProxy.blackhole`: connections are accepted (new ones too) but nothing is
  forwarded: the bytes read either way are dropped. A connection that lost bytes cannot carry
  the Kafka protocol on (frames were cut), so it stays *broken*: it keeps dropping everything.
- :meth:`~FaultyProxy.heal`: healthy again for new and unbroken connections; broken ones are
  reset, as a middlebox that lost their state would, unless ``keep_broken`` leaves them
  half-open for the endpoints' own timeouts to find.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

_CHUNK = 65536


@dataclass
class ProxyStats:
    connections: int = 0
    resets: int = 0
    broken: int = 0
    dropped_bytes: int = 0
    forwarded_bytes: int = 0

    def summary(self) -> str:
        return (
            f"proxy_connections={self.connections} proxy_resets={self.resets} "
            f"proxy_broken={self.broken} proxy_dropped_kb={self.dropped_bytes // 1024}"
        )


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a TCP RST rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Link:
    """A client's connection and the proxy's connection to the upstream on its behalf."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.writers = (client, upstream)
        self.broken = False

    def close(self) -> None:
        for writer in self.writers:
            writer.close()

    def reset(self) -> None:
        for writer in self.writers:
            _abort(writer)


class FaultyProxy:
    """Forward ``address`` to an upstream ``host:port``, with faults on demand."""

    def __init__(self, *, host: str = "127.0.0.1", seed: int = 0) -> None:
        self._sock = socket.create_server((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._upstream: tuple[str, int] | None = None
        self._delay = 0.0
        self._jitter = 0.0
        self._blackhole = False
        self._refuse_until = 0.0
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    # -- life cycle (test thread) ----------------------------------------------------------

    def start(self, *, upstream: str) -> None:
        """Forward every accepted connection to ``upstream`` (``host:port``)."""
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="faulty-proxy", daemon=True
        )
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the proxy's loop did not start")

    def close(self) -> None:
        """Reset every connection, stop listening and stop the loop. Idempotent."""
        if self._thread is None:
            self._sock.close()
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None

    # -- faults (test thread) --------------------------------------------------------------

    def add_latency(self, delay: float, *, jitter: float = 0.0) -> None:
        def act() -> None:
            self._delay, self._jitter = delay, jitter

        self._call(act)

    def reset(self, *, refuse_seconds: float = 0.0) -> None:
        def act() -> None:
            self._refuse_until = self._loop.time() + refuse_seconds
            for link in list(self._links):
                self.stats.resets += 1
                link.reset()

        self._call(act)

    def blackhole(self) -> None:
        def act() -> None:
            self._blackhole = True

        self._call(act)

    def heal(self, *, keep_broken: bool = False) -> None:
        def act() -> None:
            self._delay = self._jitter = 0.0
            self._blackhole = False
            self._refuse_until = 0.0
            if not keep_broken:
                for link in [link for link in self._links if link.broken]:
                    self.stats.resets += 1
                    link.reset()

        self._call(act)

    def _call(self, act: Callable[[], None]) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                act()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(run)
        if not done.wait(10):
            raise RuntimeError("the proxy's loop did not answer")

    # -- the loop (proxy thread) -----------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, sock=self._sock)
        )
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for link in list(self._links):
            link.reset()  # every pump reads its end of stream and returns
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        if self._loop.time() < self._refuse_until or self._upstream is None:
            self.stats.resets += 1
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            _abort(writer)
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, link), self._pump(up_reader, writer, link)
            )
        finally:
            self._links.discard(link)
            link.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        """Read one direction and queue each chunk with the time it is due on the other side."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer, link))
        due = 0.0
        try:
            while data := await reader.read(_CHUNK):
                if self._blackhole or link.broken:
                    self._drop(link, data)
                    continue
                jitter = self._rng.uniform(0, self._jitter) if self._jitter else 0.0
                due = max(due, self._loop.time() + self._delay + jitter)  # keeps the order
                queue.put_nowait((due, data))
        except OSError:
            pass
        finally:
            queue.put_nowait(None)
            await sender
            link.close()  # one side ended: end the other, as a proxy does

    async def _send(
        self,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        writer: asyncio.StreamWriter,
        link: _Link,
    ) -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - self._loop.time()) > 0:
                await asyncio.sleep(wait)
            if self._blackhole or link.broken:
                self._drop(link, data)
                continue
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                return
            self.stats.forwarded_bytes += len(data)

    def _drop(self, link: _Link, data: bytes) -> None:
        if not link.broken:
            link.broken = True
            self.stats.broken += 1
        self.stats.dropped_bytes += len(data)
