"""The gateway's HTTP/1.1 client for engine hops (services/gateway/engine_http.py) against real servers: uvicorn
for well-behaved engines, raw asyncio servers for the ones that misbehave (never answer, close mid-stream, answer
with what is not HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from yarl import URL

from switchyard.services.gateway.engine_http import HIGH_WATER, EngineHttp, EngineHttpError
from switchyard.shared.embedded import free_port
from tests.gateway_helpers import read_body, serving_asgi, wait_for

#: Only stops a broken test from hanging; nothing is asserted about it.
HANG_GUARD_S = 15.0


class Engine:
    """A uvicorn app standing in for an engine: it records each request's client port, method, path, headers
    and body, answers `/stream` with three SSE chunks (the third only once `release` is set), `/big` with 1 MiB,
    and anything else with a JSON body; it notes when a client disconnects mid-answer."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, str, dict[bytes, bytes], bytes]] = []
        self.release = asyncio.Event()
        self.disconnected = asyncio.Event()

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        self.seen.append((scope["client"][1], scope["method"], scope["path"], dict(scope["headers"]), body))
        if scope["path"] == "/stream":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
            waiting = asyncio.ensure_future(self.release.wait())
            gone = asyncio.ensure_future(receive())
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done() and gone.result()["type"] == "http.disconnect":
                self.disconnected.set()
                waiting.cancel()
                return
            gone.cancel()
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        payload = b"x" * (1 << 20) if scope["path"] == "/big" else b'{"ok": true}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


@contextlib.asynccontextmanager
async def serving(app: Engine) -> AsyncIterator[str]:
    async with serving_asgi(app, HANG_GUARD_S) as port:
        yield f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def raw_server(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """A TCP server that runs `answer` on each connection (after reading the request's head)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            await answer(reader, writer)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def deadline(seconds: float = HANG_GUARD_S) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_a_post_sends_its_head_and_body_and_reads_a_whole_answer_on_one_kept_connection() -> None:
    engine = Engine()
    async with serving(engine) as base:
        http = EngineHttp(2.0, 8)
        for n in range(3):
            body = b'{"n": %d}' % n
            response = await http.request(
                URL(base + "/v1/completions"), "POST", {"x-request-id": f"r{n}"}, body, deadline()
            )
            assert (response.status, response.content_type) == (201, "application/json")
            assert await response.read(deadline()) == b'{"ok": true}'
        await http.close()
    ports = {port for port, *_ in engine.seen}
    assert len(ports) == 1  # one connection, kept alive and reused
    _, method, path, headers, body = engine.seen[2]
    assert (method, path, body) == ("POST", "/v1/completions", b'{"n": 2}')
    assert headers[b"x-request-id"] == b"r2" and headers[b"host"] == base.removeprefix("http://").encode()


async def test_a_stream_comes_chunk_by_chunk_and_a_close_aborts_it_at_the_engine() -> None:
    engine = Engine()
    async with serving(engine) as base:
        http = EngineHttp(2.0, 8)
        response = await http.request(URL(base + "/stream"), "POST", {}, b"{}", deadline())
        assert response.content_type == "text/event-stream"
        got = [await response.chunk(deadline())]
        while b"data: 2" not in b"".join(got):
            got.append(await response.chunk(deadline()))
        response.close()  # the client went away: the engine must see the connection close
        await asyncio.wait_for(engine.disconnected.wait(), HANG_GUARD_S)
        engine.release.set()
        response = await http.request(URL(base + "/stream"), "POST", {}, b"{}", deadline())
        body = b"".join([piece async for piece in response.chunks(HANG_GUARD_S)])
        assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        response.release()
        await http.close()
    assert len({port for port, *_ in engine.seen}) == 2  # the closed connection was not reused


async def test_a_large_answer_is_read_whole_past_the_read_ahead_bound() -> None:
    engine = Engine()
    async with serving(engine) as base:
        http = EngineHttp(2.0, 8)
        response = await http.request(URL(base + "/big"), "GET", {}, b"", deadline())
        connection = response._connection
        await wait_for(lambda: connection.paused or connection.complete, HANG_GUARD_S)
        assert connection.paused and connection.buffered > HIGH_WATER  # reading stopped ahead of the reader
        assert await response.read(deadline()) == b"x" * (1 << 20)
        await http.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    http = EngineHttp(2.0, 8)
    with pytest.raises(EngineHttpError) as failed:
        await http.request(URL(f"http://127.0.0.1:{free_port()}/health"), "GET", {}, b"", deadline())
    assert failed.value.reason == "connect"


async def test_an_engine_that_never_answers_times_out_and_the_slot_is_freed() -> None:
    async def never(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client closes

    async with raw_server(never) as base:
        http = EngineHttp(2.0, 1)
        for _ in range(2):  # with one slot, the second call runs only if the first freed it
            with pytest.raises(EngineHttpError) as failed:
                await http.request(URL(base + "/v1/completions"), "POST", {}, b"{}", deadline(0.2))
            assert failed.value.reason == "timeout"


async def test_an_engine_closing_mid_stream_or_answering_garbage_is_closed() -> None:
    async def half(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()

    async def garbage(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(HANG_GUARD_S)

    http = EngineHttp(2.0, 8)
    async with raw_server(half) as base:
        response = await http.request(URL(base + "/s"), "POST", {}, b"{}", deadline())
        assert await response.chunk(deadline()) == b"data: 1\n\n"
        with pytest.raises(EngineHttpError) as failed:
            await response.chunk(deadline())
        assert failed.value.reason == "closed"
        response.close()
    async with raw_server(garbage) as base:
        with pytest.raises(EngineHttpError) as failed:
            await http.request(URL(base + "/s"), "POST", {}, b"{}", deadline())
        assert failed.value.reason == "closed"


async def test_a_pooled_connection_the_engine_closed_is_replaced_and_the_request_sent_once() -> None:
    """The engine closes a kept connection after answering (its keep-alive ran out): the next request goes on a
    new connection, whether the close arrived before it was sent or raced it, and reaches the engine once."""
    requests: list[bytes] = []

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(b"seen")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()  # and close, though the answer said nothing of it

    async with raw_server(once) as base:
        http = EngineHttp(2.0, 8)
        for settle in (0.05, 0.0, 0.0):  # the close arrived first; then sent right behind the answer (racing it)
            response = await http.request(URL(base + "/health"), "GET", {}, b"", deadline())
            assert await response.read(deadline()) == b"ok"
            await asyncio.sleep(settle)
        await wait_for(lambda: not any(http._idle.values()), HANG_GUARD_S)  # the engine's close empties the pool
        await http.close()
    assert len(requests) == 3


async def test_a_header_with_a_line_break_is_refused() -> None:
    http = EngineHttp(2.0, 8)
    with pytest.raises(ValueError, match="line break"):
        await http.request(URL("http://127.0.0.1:1/x"), "POST", {"authorization": "a\r\nx-evil: 1"}, b"", deadline())


# --- issue 37: what an engine answers is bounded (bytes of a whole answer, bytes and time of a head) ---


class _Sent:
    """What a hostile raw server managed to write before the client closed the connection."""

    def __init__(self) -> None:
        self.bytes = 0
        self.closed = asyncio.Event()

    async def write(self, writer: asyncio.StreamWriter, data: bytes, limit: int) -> None:
        """Write `data` until `limit` bytes went out or the client closed; then wait for the close."""
        writer.transport.set_write_buffer_limits(high=0)  # drain waits for the kernel: counts what left
        try:
            while self.bytes < limit:
                writer.write(data)
                await writer.drain()
                self.bytes += len(data)
            await asyncio.sleep(HANG_GUARD_S)
        finally:
            self.closed.set()


async def test_an_answer_declaring_more_than_the_bound_fails_at_its_head() -> None:
    sent = _Sent()

    async def declares(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n")
        await sent.write(writer, b"x" * 65536, 64 << 20)

    async with raw_server(declares) as base:
        http = EngineHttp(2.0, 8)
        response = await http.request(URL(base + "/v1/completions"), "POST", {}, b"{}", deadline())
        with pytest.raises(EngineHttpError) as failed:
            await response.read(deadline(), max_bytes=1 << 20)
        await asyncio.wait_for(sent.closed.wait(), HANG_GUARD_S)
    assert failed.value.reason == "too_large"
    assert response._connection.lost  # closed, not pooled
    assert sent.bytes < 16 << 20  # the kernel's buffers at most: 64 MiB before (read to the deadline)


async def test_an_undeclared_answer_fails_once_its_bytes_pass_the_bound_and_one_at_it_is_read() -> None:
    sent = _Sent()

    async def chunked(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        await sent.write(writer, b"10000\r\n" + b"x" * 65536 + b"\r\n", 64 << 20)

    async def exact(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 65536\r\n\r\n" + b"y" * 65536)
        await writer.drain()

    http = EngineHttp(2.0, 8)
    async with raw_server(chunked) as base:
        response = await http.request(URL(base + "/v1/completions"), "POST", {}, b"{}", deadline())
        with pytest.raises(EngineHttpError) as failed:
            await response.read(deadline(), max_bytes=1 << 20)
        await asyncio.wait_for(sent.closed.wait(), HANG_GUARD_S)
    assert failed.value.reason == "too_large"
    assert sent.bytes < 16 << 20
    async with raw_server(exact) as base:
        response = await http.request(URL(base + "/v1/completions"), "POST", {}, b"{}", deadline())
        assert await response.read(deadline(), max_bytes=65536) == b"y" * 65536


async def test_a_never_ending_header_fails_at_the_head_bound_and_is_not_parsed_further() -> None:
    """`x-a: aaaa...` in 64 KiB writes: the client closes once the head passes its bound (before: it read, and
    httptools concatenated, until the deadline)."""
    sent = _Sent()

    async def endless(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-a: ")
        await sent.write(writer, b"a" * 65536, 32 << 20)

    async with raw_server(endless) as base:
        http = EngineHttp(2.0, 8, max_head_bytes=64 * 1024)
        with pytest.raises(EngineHttpError) as failed:
            await http.request(URL(base + "/v1/completions"), "POST", {}, b"{}", deadline())
        await asyncio.wait_for(sent.closed.wait(), HANG_GUARD_S)
    assert failed.value.reason == "head_too_large"
    assert sent.bytes < 16 << 20


async def test_a_trickling_head_fails_at_the_head_deadline_but_a_late_whole_answer_does_not() -> None:
    """The head deadline runs from the head's first byte: a head sent a line at a time fails; an answer whose
    head comes late (a non-streaming answer, sent when ready) but whole is read."""

    async def trickle(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for n in range(int(HANG_GUARD_S / 0.05)):
            writer.write(b"x-%d: a\r\n" % n)
            await writer.drain()
            await asyncio.sleep(0.05)

    async def late(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.6)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    http = EngineHttp(2.0, 8, head_timeout_s=0.3)
    async with raw_server(trickle) as base:
        with pytest.raises(EngineHttpError) as failed:
            await http.request(URL(base + "/v1/completions"), "POST", {}, b"{}", deadline())
    assert failed.value.reason == "head_timeout"
    async with raw_server(late) as base:
        response = await http.request(URL(base + "/v1/completions"), "POST", {}, b"{}", deadline())
        assert await response.read(deadline(), max_bytes=1024) == b"ok"


async def test_one_huge_stream_chunk_comes_in_pieces_of_one_socket_read_with_the_read_ahead_bounded() -> None:
    """A streamed answer is relayed piece by piece: one 4 MiB chunk of chunked encoding (or one SSE event without
    its blank line) reaches the reader as pieces of at most one socket read (asyncio's 256 KiB), and no more than
    `HIGH_WATER` plus one read is ever held ahead of a slow reader."""
    size = 4 << 20

    async def one_chunk(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n" % size + b"d" * size + b"\r\n0\r\n\r\n")
        await writer.drain()

    async with raw_server(one_chunk) as base:
        http = EngineHttp(2.0, 8)
        response = await http.request(URL(base + "/stream"), "POST", {}, b"{}", deadline())
        connection = response._connection
        pieces, most_held = [], 0
        while piece := await response.chunk(deadline()):
            pieces.append(len(piece))
            most_held = max(most_held, connection.buffered + len(piece))
            await asyncio.sleep(0.001)  # a slow client
        response.release()
        await http.close()
    assert sum(pieces) == size
    assert max(pieces) <= 256 * 1024
    assert most_held <= HIGH_WATER + 256 * 1024
