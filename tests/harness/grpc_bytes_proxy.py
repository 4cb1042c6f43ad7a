"""A loopback TCP proxy that counts the body bytes of each HTTP call, by path and direction.

Between SuperNodes and the SuperLink's Fleet API (plaintext, loopback): every byte forwarded
unchanged, both directions parsed. A connection opening with the HTTP/2 preface (gRPC, h2c)
is read as frames: HEADERS + CONTINUATION decoded with ``hpack`` (a decoder a direction) for
each stream's ``:path``, DATA payloads summed (padding left out); any other as HTTP/1.1
(Flower 1.42's protobuf over HTTP: Content-Length or chunked bodies, responses in request
order). Headers, frame headers and chunk-size lines are not counted. ``bytes_by_path()``:
{(path, "up" | "down"): bytes}, "up" what the client sent; ``stop()`` closes every socket
and joins every thread. Not a test module (``__test__ = False``).
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
from collections.abc import Callable

from hpack import Decoder, HPACKError

__test__ = False

UP, DOWN = "up", "down"  # client -> server, server -> client
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# HTTP/2 frame types and flags (RFC 9113, section 6)
DATA, HEADERS, SETTINGS, PUSH_PROMISE, CONTINUATION = 0x0, 0x1, 0x4, 0x5, 0x9
END_HEADERS, PADDED, PRIORITY = 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE = 0x1
MAX_HEAD = 256 * 1024  # an HTTP/1.1 head longer than this is not HTTP: stop parsing

Count = Callable[[str, str, int], None]  # (path, direction, body bytes)


class ParseError(ValueError):
    """The bytes seen are not the protocol expected (forwarding goes on)."""


class Http1Direction:
    """One direction of an HTTP/1.1 connection: requests (``UP``, each path queued for its
    response) or responses (``DOWN``, each counted under the oldest unanswered request)."""

    def __init__(self, direction: str, paths: collections.deque[str], count: Count) -> None:
        self.direction, self.paths, self.count = direction, paths, count
        self.buffer = bytearray()
        self.state = "head"  # head | length | chunk-size | chunk | chunk-end | trailer | eof
        self.remaining = 0
        self.path = ""
        self.body = 0

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while self.buffer and self.step():
            pass

    def close(self) -> None:
        if self.state == "eof":  # a body that ran to the end of the connection
            self.done()

    def done(self) -> None:
        self.count(self.path, self.direction, self.body)
        self.state, self.body = "head", 0

    def take(self, n: int) -> None:
        """Consume ``n`` body bytes from the buffer."""
        del self.buffer[:n]
        self.body += n
        self.remaining -= n

    def line(self) -> bytes | None:
        end = self.buffer.find(b"\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                raise ParseError("no end of line")
            return None
        text = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return text

    def step(self) -> bool:
        """Parse what the buffer allows of the current state; False when it needs more."""
        if self.state == "head":
            return self.head()
        if self.state in ("length", "chunk"):
            n = min(self.remaining, len(self.buffer))
            self.take(n)
            if self.remaining == 0:
                if self.state == "length":
                    self.done()
                else:
                    self.state = "chunk-end"
            return n > 0 or self.remaining == 0
        if self.state == "eof":
            self.take(len(self.buffer))
            return False
        text = self.line()
        if text is None:
            return False
        if self.state == "chunk-size":
            self.remaining = int(text.split(b";", 1)[0].strip(), 16)
            self.state = "chunk" if self.remaining else "trailer"
        elif self.state == "chunk-end":
            self.state = "chunk-size"
        elif self.state == "trailer" and not text:
            self.done()
        return True

    def head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                raise ParseError("no end of HTTP/1.1 head")
            return False
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        del self.buffer[: end + 4]
        first = lines[0].split(" ")
        headers = {}
        for field in lines[1:]:
            name, _, value = field.partition(":")
            headers[name.strip().lower()] = value.strip()
        if self.direction == UP:
            if len(first) != 3 or not first[2].startswith("HTTP/1."):
                raise ParseError(f"not an HTTP/1.1 request line: {lines[0][:80]!r}")
            self.path = first[1]
            self.paths.append(self.path)
        else:
            if len(first) < 2 or not first[0].startswith("HTTP/1."):
                raise ParseError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
            status = int(first[1])
            if 100 <= status < 200:  # an interim response: the final one follows
                return True
            self.path = self.paths.popleft() if self.paths else "?"
            if status in (204, 304):
                self.done()
                return True
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = "chunk-size"
        elif "content-length" in headers:
            self.remaining = int(headers["content-length"])
            self.state = "length"
            if self.remaining == 0:
                self.done()
        elif self.direction == DOWN:  # no length: the body runs to the connection's end
            self.state = "eof"
        else:  # a request without a body
            self.done()
        return True


class H2Connection:
    """Both directions of an HTTP/2 connection: each stream's ``:path`` from the client's
    headers, DATA payloads counted under it; one HPACK decoder a direction."""

    def __init__(self, count: Count) -> None:
        self.count = count
        self.decoders = {UP: Decoder(), DOWN: Decoder()}
        for decoder in self.decoders.values():
            decoder.max_header_list_size = 1 << 24
        self.buffers = {UP: bytearray(), DOWN: bytearray()}
        self.preface = {UP: len(H2_PREFACE), DOWN: 0}  # bytes of preface still to skip
        self.block: dict[str, tuple[int, bytearray] | None] = {UP: None, DOWN: None}
        self.paths: dict[int, str] = {}

    def feed(self, direction: str, data: bytes) -> None:
        buffer = self.buffers[direction]
        buffer += data
        if self.preface[direction]:
            skip = min(self.preface[direction], len(buffer))
            del buffer[:skip]
            self.preface[direction] -= skip
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                return
            kind, flags = buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            payload = bytes(buffer[9 : 9 + length])
            del buffer[: 9 + length]
            self.frame(direction, kind, flags, stream, payload)

    def frame(self, direction: str, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == DATA:
            pad = payload[0] + 1 if flags & PADDED else 0
            self.count(self.paths.get(stream, "?"), direction, len(payload) - pad)
        elif kind in (HEADERS, PUSH_PROMISE):
            start, pad = 0, 0
            if flags & PADDED:
                start, pad = 1, payload[0]
            if kind == HEADERS and flags & PRIORITY:
                start += 5  # stream dependency and weight
            if kind == PUSH_PROMISE:
                start += 4  # the promised stream id
            self.block[direction] = (stream, bytearray(payload[start : len(payload) - pad]))
            if flags & END_HEADERS:
                self.headers(direction)
        elif kind == CONTINUATION:
            block = self.block[direction]
            if block is None:
                raise ParseError("CONTINUATION without HEADERS")
            block[1].extend(payload)
            if flags & END_HEADERS:
                self.headers(direction)
        elif kind == SETTINGS and not flags & 0x1:  # not an ACK
            # the sender's decoder may hold this much: the other direction's encoder uses it
            other = self.decoders[DOWN if direction == UP else UP]
            for i in range(0, len(payload) - 5, 6):
                if int.from_bytes(payload[i : i + 2], "big") == SETTINGS_HEADER_TABLE_SIZE:
                    other.max_allowed_table_size = int.from_bytes(payload[i + 2 : i + 6], "big")

    def headers(self, direction: str) -> None:
        block = self.block[direction]
        assert block is not None
        stream, fragment = block
        self.block[direction] = None
        fields = dict(self.decoders[direction].decode(bytes(fragment), raw=False))
        if direction == UP and ":path" in fields:
            self.paths[stream] = fields[":path"]


class ByteCountingProxy:
    """Listens on ``127.0.0.1:<port>`` (a free one) and forwards each connection to
    ``target_host:target_port``, counting body bytes by path and direction. A context
    manager; ``stop()`` closes every socket and joins every thread it started."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)  # the accept loop looks at the stop flag this often
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.totals: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bodies: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        self.errors: list[str] = []
        self.connections = 0
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.stopping = threading.Event()
        self.acceptor = threading.Thread(target=self.accept_loop, name="proxy-accept")

    # -- counts ------------------------------------------------------------------------
    def count(self, path: str, direction: str, n: int) -> None:
        with self.lock:
            self.totals[(path, direction)] += n
            self.bodies[(path, direction)].append(n)

    def bytes_by_path(self) -> dict[tuple[str, str], int]:
        """{(path, direction): the body bytes seen, summed}."""
        with self.lock:
            return dict(self.totals)

    def bodies_by_path(self) -> dict[tuple[str, str], list[int]]:
        """{(path, direction): each body's bytes (HTTP/1.1) or each DATA frame's (HTTP/2)}."""
        with self.lock:
            return {key: list(sizes) for key, sizes in self.bodies.items()}

    # -- running -----------------------------------------------------------------------
    def start(self) -> ByteCountingProxy:
        self.acceptor.start()
        return self

    def accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.open(client, server)

    def open(self, client: socket.socket, server: socket.socket) -> None:
        with self.lock:
            if self.stopping.is_set():
                client.close()
                server.close()
                return
            self.connections += 1
            self.sockets += [client, server]
            number = self.connections
        parser = ConnectionParser(self.count, self.errors, self.lock)
        for direction, src, dst in ((UP, client, server), (DOWN, server, client)):
            thread = threading.Thread(
                target=self.pump, args=(direction, src, dst, parser),
                name=f"proxy-{number}-{direction}", daemon=True,
            )  # fmt: skip
            with self.lock:
                self.threads.append(thread)
            thread.start()

    def pump(self, direction: str, src: socket.socket, dst: socket.socket, parser) -> None:
        """Copy ``src`` to ``dst``, each chunk parsed before it is forwarded (so a request's
        path is known before its response can arrive); at the end, half-close ``dst``."""
        try:
            while data := src.recv(1 << 16):
                parser.feed(direction, data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            parser.close(direction)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        self.stopping.set()
        if self.acceptor.is_alive():
            self.acceptor.join()
        self.listener.close()
        with self.lock:
            sockets, threads = list(self.sockets), list(self.threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=10)
        for sock in sockets:
            sock.close()
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"proxy threads still running: {alive}")

    def __enter__(self) -> ByteCountingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ConnectionParser:
    """Picks HTTP/2 or HTTP/1.1 from the client's first bytes and parses both directions;
    a parse error is recorded in ``errors`` and ends parsing of that connection."""

    def __init__(self, count: Count, errors: list[str], lock: threading.Lock) -> None:
        self.count, self.errors, self.lock = count, errors, lock
        self.first = bytearray()  # the client's first bytes, until the protocol is known
        self.pending: list[tuple[str, bytes]] = []  # server bytes seen before that
        self.h2: H2Connection | None = None
        self.h1: dict[str, Http1Direction] | None = None
        self.failed = False
        self.guard = threading.Lock()  # both pumps feed one parser

    def feed(self, direction: str, data: bytes) -> None:
        with self.guard:
            if self.failed:
                return
            try:
                self.dispatch(direction, data)
            except (ParseError, HPACKError, ValueError, KeyError, IndexError) as err:
                self.failed = True
                with self.lock:
                    self.errors.append(f"{direction}: {type(err).__name__}: {err}")

    def dispatch(self, direction: str, data: bytes) -> None:
        if self.h2 is None and self.h1 is None:
            if direction == DOWN:
                self.pending.append((direction, data))
                return
            self.first += data
            if len(self.first) < len(H2_PREFACE) and H2_PREFACE.startswith(self.first):
                return  # maybe the HTTP/2 preface: wait for all 24 bytes
            data, self.first = bytes(self.first), bytearray()
            if data.startswith(H2_PREFACE):
                self.h2 = H2Connection(self.count)
            else:
                paths: collections.deque[str] = collections.deque()
                self.h1 = {UP: Http1Direction(UP, paths, self.count),
                           DOWN: Http1Direction(DOWN, paths, self.count)}  # fmt: skip
            self.route(UP, data)
            for pending in self.pending:
                self.route(*pending)
            self.pending.clear()
            return
        self.route(direction, data)

    def route(self, direction: str, data: bytes) -> None:
        if self.h2 is not None:
            self.h2.feed(direction, data)
        elif self.h1 is not None:
            self.h1[direction].feed(data)

    def close(self, direction: str) -> None:
        with self.guard:
            if self.h1 is not None and not self.failed:
                self.h1[direction].close()
