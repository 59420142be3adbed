"""The HTTP front of the gateway and the API (services/http_server.py, shared/json_depth.py) on real uvicorn
servers, spoken to over raw sockets as a hostile client would: slowloris sockets, more connections than the cap,
deeply nested JSON. Issue 29, item 5."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.api.server import run_api
from switchyard.services.api.settings import ApiSettings
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.http_server import HeadWithBody, front_protocol
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import free_port
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment, metric, serving_asgi, wait_for
from tests.test_http_limits import _exchange

HEADER_TIMEOUT_S = 1.0
#: Only stops a broken test from hanging; nothing is asserted about it.
HANG_GUARD_S = 15.0
DROPPED = "switchyard_http_connections_dropped_total"


# --- raw-socket clients ---


async def _slowloris(port: int, keep_alive: bool = False) -> float:
    """One slowloris socket: a header line one byte every 0.1 s, never finished. Returns how long the server let
    it trickle before closing it. With `keep_alive`, first a whole request, an idle pause of 1.5 header deadlines
    (which must not close it: that is the keep-alive timeout's job) and a second request on the same connection."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if keep_alive:
            assert await _get(writer, reader, "/healthz") == 200
            await asyncio.sleep(1.5 * HEADER_TIMEOUT_S)
            assert await _get(writer, reader, "/healthz") == 200
        started = loop.time()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        closed = asyncio.ensure_future(reader.read(1))
        while True:
            await asyncio.wait({closed}, timeout=0.1)
            if closed.done():
                with contextlib.suppress(ConnectionError):
                    assert closed.result() == b"", "the server answered a request it never got"
                return loop.time() - started
            with contextlib.suppress(ConnectionError):
                writer.write(b"a")
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return int(head.split(b" ", 2)[1]), await reader.readexactly(length)


async def _get(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, path: str) -> int:
    """One keep-alive GET on an open connection; its status."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, _ = await _read_response(reader)
    return status


async def _read_until_closed(port: int) -> tuple[bytes, bool]:
    """Connect, send nothing, read: what the server wrote, and whether it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()
    try:
        async with asyncio.timeout(3.0):
            with contextlib.suppress(ConnectionError):
                while chunk := await reader.read(65536):
                    received.extend(chunk)
        return bytes(received), True
    except TimeoutError:
        return bytes(received), False
    finally:
        writer.close()


@contextlib.contextmanager
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """Records at ERROR or above, from the root logger and uvicorn's (which the gateway's uvicorn config keeps
    from propagating)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.ERROR)
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


# --- the services ---


@contextlib.asynccontextmanager
async def gateway(settings: SwitchyardSettings, bus: Bus, **limits: float) -> AsyncIterator[GatewayService]:
    config = GatewaySettings(port=0, route_timeout_s=0.5, **limits)  # type: ignore[arg-type]
    async with deployment(settings, bus, [StubConfig("a")], router=False, gateway=config) as (service, _engines):
        yield service


@contextlib.asynccontextmanager
async def api(settings: SwitchyardSettings, tmp_path: Path, **limits: float) -> AsyncIterator[int]:
    """`switchyard api` (SQLite, the test's NATS) on a free port, up once /healthz answers."""
    settings = settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'api.sqlite'}"})
    config = ApiSettings(host="127.0.0.1", port=free_port(), token="t", **limits)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(run_api(settings, stop, config))
    try:
        async with asyncio.timeout(30):
            while True:
                if task.done():
                    task.result()
                with contextlib.suppress(OSError, ValueError, IndexError):
                    if (await _exchange(config.port, _get_head("/healthz"), []))[0] == 200:
                        break
                await asyncio.sleep(0.05)
        yield config.port
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


def _get_head(path: str) -> str:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _post_head(path: str, length: int) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Authorization: Bearer t", "Content-Type: application/json"]
    return "\r\n".join([*lines, f"Content-Length: {length}", "Connection: close"]) + "\r\n\r\n"


# --- slowloris ---


async def _slowloris_attack(port: int, sockets: int) -> tuple[list[float], int, int]:
    """`sockets` slowloris sockets plus one that trickles after two keep-alive requests, and an honest request sent
    while they trickle. Returns how long each slow socket lasted, the honest status, and how many the server
    did not close (on code without a header deadline: all of them)."""
    attack = [asyncio.create_task(_slowloris(port)) for _ in range(sockets)]
    attack.append(asyncio.create_task(_slowloris(port, keep_alive=True)))
    await asyncio.sleep(0.3)  # all are trickling
    honest, _ = await _exchange(port, _get_head("/healthz"), [])
    done, pending = await asyncio.wait(attack, timeout=HANG_GUARD_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [task.result() for task in done], honest, len(pending)


async def test_the_gateway_closes_slowloris_sockets_at_the_header_deadline(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """100 sockets each trickling a header line one byte every 0.1 s (and one doing so after two keep-alive requests
    with an idle pause between them longer than the deadline) are all closed once `header_timeout_s` has passed,
    however steadily they trickle; an honest request sent during the attack is served."""
    async with gateway(settings, bus, header_timeout_s=HEADER_TIMEOUT_S) as gw:
        assert gw.port is not None
        before = metric(DROPPED, reason="header_timeout")
        lasted, honest, still_open = await _slowloris_attack(gw.port, 100)
        dropped = metric(DROPPED, reason="header_timeout") - before
    assert still_open == 0
    assert honest == 200
    assert len(lasted) == 101 and min(lasted) >= 0.9 * HEADER_TIMEOUT_S  # the deadline, not something sooner
    assert dropped == 101


async def test_the_api_closes_slowloris_sockets_at_the_header_deadline(
    settings: SwitchyardSettings, tmp_path: Path
) -> None:
    async with api(settings, tmp_path, header_timeout_s=HEADER_TIMEOUT_S) as port:
        lasted, honest, still_open = await _slowloris_attack(port, 50)
    assert still_open == 0
    assert honest == 200
    assert len(lasted) == 51 and min(lasted) >= 0.9 * HEADER_TIMEOUT_S


# --- the connection cap ---


async def _over_the_cap(port: int, cap: int, extra: int, path: str) -> tuple[list[int], list[tuple[bytes, bool]]]:
    """`cap` keep-alive connections, each served once, then `extra` more. Returns the first ones' statuses on a
    second request (after the extra ones were turned away) and what each extra one got."""
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
    try:
        for reader, writer in held:
            assert await _get(writer, reader, path) == 200
        turned_away = [await _read_until_closed(port) for _ in range(extra)]
        again = [await _get(writer, reader, path) for reader, writer in held]
    finally:
        for _, writer in held:
            writer.close()
    return again, turned_away


async def test_the_gateway_turns_away_connections_over_the_cap(bus: Bus, settings: SwitchyardSettings) -> None:
    """With 4 open, a 5th, 6th and 7th connection are answered 503 (OpenAI's shape) and closed at once, without
    sending a byte; the 4 keep being served, and once they close new connections are served again."""
    async with gateway(settings, bus, max_client_connections=4, header_timeout_s=30) as gw:
        assert gw.port is not None and gw.server is not None
        before = metric(DROPPED, reason="cap")
        again, turned_away = await _over_the_cap(gw.port, 4, 3, "/healthz")
        dropped = metric(DROPPED, reason="cap") - before
        state = gw.server.server_state
        await wait_for(lambda: not state.connections)  # the server has seen the 4 close
        after, _ = await _exchange(gw.port, _get_head("/healthz"), [])
    assert again == [200] * 4
    for answer, closed in turned_away:
        assert closed and answer.startswith(b"HTTP/1.1 503 ")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "ServiceUnavailableError"
    assert dropped == 3
    assert after == 200


async def test_the_api_turns_away_connections_over_the_cap(settings: SwitchyardSettings, tmp_path: Path) -> None:
    async with api(settings, tmp_path, max_connections=3, header_timeout_s=30) as port:
        again, turned_away = await _over_the_cap(port, 3, 2, "/healthz")
        after = 0  # until the server has seen the 3 close, a new connection may still be turned away
        async with asyncio.timeout(HANG_GUARD_S):
            while after != 200:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    after, _ = await _exchange(port, _get_head("/healthz"), [])
                await asyncio.sleep(0.05)
    assert again == [200] * 3
    for answer, closed in turned_away:
        assert closed and answer.startswith(b"HTTP/1.1 503 ")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"detail": "too many connections"}
    assert after == 200


# --- deeply nested JSON ---


def _nested_bodies() -> dict[str, bytes]:
    prompt = b'{"model": "stub-model", "prompt": "x", "max_tokens": 2, "extra": '
    return {
        "100,000 [": b"[" * 100_000,
        '100,000 {"a":': b'{"a":' * 100_000,
        "200 levels, well formed": prompt + b"[" * 200 + b"]" * 200 + b"}",
    }


async def test_the_gateway_answers_deeply_nested_json_400_without_a_traceback(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """100,000 `[` made a RecursionError: a 500 and a traceback per request. Now a 400 in OpenAI's shape, counted
    as a bad request; nothing logged at ERROR; a shallow request is still served."""
    async with gateway(settings, bus) as gw:
        assert gw.port is not None
        path = "/v1/completions"
        before = metric("switchyard_gateway_bad_requests_total", reason="too_deep")
        answers = {}
        with errors_logged() as errors:
            for name, body in _nested_bodies().items():
                answers[name] = await _exchange(gw.port, _post_head(path, len(body)), [body])
            shallow = json.dumps({"model": "stub-model", "prompt": "x", "max_tokens": 2, "extra": [[[[1]]]]}).encode()
            served, _ = await _exchange(gw.port, _post_head(path, len(shallow)), [shallow])
        counted = metric("switchyard_gateway_bad_requests_total", reason="too_deep") - before
    for name, (status, body) in answers.items():
        assert status == 400, name
        assert json.loads(body)["error"]["type"] == "BadRequestError", name
    assert served == 200
    assert [r.getMessage() for r in errors] == []
    assert counted == 3


async def test_the_api_answers_deeply_nested_json_400_without_a_traceback(
    settings: SwitchyardSettings, tmp_path: Path
) -> None:
    """The API's FastAPI turned 100,000 `[` into a 400 already, but a body 900-1000 levels deep parsed and then
    broke encoding its own 422 (RecursionError: a 500 and a traceback). Every depth there is now a 400."""
    bodies = _nested_bodies()
    for levels in range(900, 1000):
        bodies[f"{levels} levels"] = b'{"engine_group": ' + b"[" * levels + b"]" * levels + b"}"
    async with api(settings, tmp_path) as port:
        answers = {}
        with errors_logged() as errors:
            for name, body in bodies.items():
                answers[name] = await _exchange(port, _post_head("/v1/calibrations", len(body)), [body])
    wrong = {name: status for name, (status, _body) in answers.items() if status != 400}
    assert wrong == {}
    assert all("detail" in json.loads(body) for _status, body in answers.values())
    assert [r.getMessage() for r in errors] == []


def test_the_gateway_bound_is_128_levels_and_brackets_in_strings_do_not_count() -> None:
    """The bound is exact: 128 levels parse, 129 are refused; a prompt full of brackets (code) is not nested."""
    from switchyard.services.gateway.body import BadBody, parse

    def body(levels: int, prompt: str = "x") -> bytes:
        # the body object is one level, `extra` holds the rest
        extra = "[" * (levels - 1) + "]" * (levels - 1)
        return f'{{"prompt": {json.dumps(prompt)}, "extra": {extra}}}'.encode()

    assert parse(body(128), chat=False).prompt_tokens == 1
    code = "def f(x):\n    return [{x[i]: [i]} for i in range(3)]\n" * 500  # 2,000 opening brackets
    assert parse(body(128, code), chat=False).body["prompt"] == code
    try:
        parse(body(129), chat=False)
    except BadBody as exc:
        refused = exc.reason
    else:
        refused = None
    assert refused == "too_deep"


# --- a response's head goes out with its first body chunk (HeadWithBody) ---


class _Recording(asyncio.Transport):
    """Records what is written (the test looks at write boundaries, which a socket does not keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True


async def test_a_responses_head_is_written_with_its_first_body_chunk() -> None:
    loop = asyncio.get_running_loop()
    sink = _Recording()
    head = HeadWithBody(sink, loop)
    head.write(b"HTTP/1.1 200 OK\r\n\r\n")
    head.write(b"5\r\nfirst\r\n")
    head.write(b"6\r\nsecond\r\n")
    assert sink.writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nfirst\r\n", b"6\r\nsecond\r\n"]
    await asyncio.sleep(0)
    assert len(sink.writes) == 2  # the release on the next turn finds nothing held


async def test_a_head_without_a_body_yet_goes_out_on_the_next_turn_and_before_a_close() -> None:
    loop = asyncio.get_running_loop()
    sink = _Recording()
    HeadWithBody(sink, loop).write(b"HEAD")
    assert sink.writes == []
    await asyncio.sleep(0)
    assert sink.writes == [b"HEAD"]
    closing = _Recording()
    held = HeadWithBody(closing, loop)
    held.write(b"HEAD")
    held.close()
    assert closing.writes == [b"HEAD"] and closing.closed


async def test_a_real_server_sends_a_head_whose_body_waits_and_keeps_the_connection() -> None:
    """Through uvicorn with the front protocol: a response whose body waits for the client to have read the head
    (the app holds it until then) is not held up, and the next request on the same connection is answered whole."""
    head_read = asyncio.Event()

    async def app(scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        await send(start)  # type: ignore[operator]
        if scope["path"] == "/late":
            await head_read.wait()  # never set, were the head held until the body
        await send({"type": "http.response.body", "body": b"hello", "more_body": False})  # type: ignore[operator]

    async with serving_asgi(app, HANG_GUARD_S, http=front_protocol(5.0, 16, {"detail": "x"})) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /late HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD_S)
        assert head.startswith(b"HTTP/1.1 200") and b"hello" not in head
        head_read.set()
        assert b"hello" in await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), HANG_GUARD_S)
        writer.write(b"GET /now HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), HANG_GUARD_S)
        assert answer.startswith(b"HTTP/1.1 200") and b"hello" in answer
        writer.close()


async def test_a_client_that_expects_100_continue_gets_it_and_then_the_answer() -> None:
    """`Expect: 100-continue`: uvicorn writes `100 Continue` through the head-holding transport when the app first
    reads the body; the client (waiting for it before it sends the body, as curl does) gets it, then the answer."""

    async def app(scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        message = await receive()  # type: ignore[operator]
        start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        await send(start)  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"got " + message["body"]})  # type: ignore[operator]

    async with serving_asgi(app, HANG_GUARD_S, http=front_protocol(5.0, 16, {"detail": "x"})) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /up HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD_S)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hello")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD_S)
        assert head.startswith(b"HTTP/1.1 200")
        assert b"got hello" in await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), HANG_GUARD_S)
        writer.close()
