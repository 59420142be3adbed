"""The gateway's pure parts: body checks, local choices, the registry, the signature box, the handoff bodies,
and the router's selectable DP rule."""

from __future__ import annotations

import asyncio
import collections
import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.services.gateway.body import BadBody, parse
from switchyard.services.gateway.choice import least_loaded, pick_prefill, rendezvous_order
from switchyard.services.gateway.disagg import decode_body, prefill_body, signature_in
from switchyard.services.gateway.registry import GatewayRegistry
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.gateway.signatures import (
    MISSES_BEFORE_NO_WAIT,
    REQUEST_ID,
    SignatureBox,
    new_request_id,
)
from switchyard.services.router.core import RouterCore
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.errors import ConfigError
from switchyard.shared.liveness import Liveness
from switchyard.shared.schemas import Capacity, Hello, ModelShape, PrefillSignature, RouteDpRequest, Telemetry
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.signature_json import ENGINE_KEY, SIGNATURE_KEY, signature_to_json


def hello(
    engine_id: str, role: str = "dp", base_url: str | None = "http://127.0.0.1:1", interval: float = 1.0
) -> Hello:
    return Hello(
        engine_id=engine_id,
        role=role,
        model=ModelShape(name="m", num_layers=2, num_experts=4, top_k=1),
        ep_group="g",
        gpus=["0"],
        capacity=Capacity(max_running=8, kv_blocks=10, block_size=16),
        ts=0.0,
        agent="sim",
        hello_interval_s=interval,
        base_url=base_url,
    )


# ----- bodies -----


@pytest.mark.parametrize(
    ("raw", "chat", "param"),
    [
        (b"{", False, None),
        (b'"text"', False, None),
        (b'{"prompt": 3}', False, "prompt"),
        (b'{"prompt": []}', False, "prompt"),
        (b'{"prompt": "x", "model": 1}', False, "model"),
        (b'{"prompt": "x", "stream": 1}', False, "stream"),
        (b'{"prompt": "x", "max_tokens": true}', False, "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 0}', False, "max_tokens"),
        (b'{"messages": "hi"}', True, "messages"),
        (b'{"messages": [1]}', True, "messages"),
    ],
)
def test_bad_bodies_name_what_is_wrong(raw: bytes, chat: bool, param: str | None) -> None:
    with pytest.raises(BadBody) as caught:
        parse(raw, chat)
    assert caught.value.param == param and str(caught.value)


def test_prompt_forms_are_sized_and_prefixed() -> None:
    assert parse(b'{"prompt": "abcdefgh"}', False).prompt_tokens == 2
    assert parse(b'{"prompt": [1, 2, 3]}', False).prompt_tokens == 3
    assert parse(b'{"prompt": [[1, 2], [3]]}', False).prompt_tokens == 3
    assert parse(b'{"prompt": ["abcd", "efgh"], "stream": true}', False).stream is True
    one = parse(b'{"prompt": "' + b"x" * 600 + b'a"}', False, prefix_chars=512)
    two = parse(b'{"prompt": "' + b"x" * 600 + b'b"}', False, prefix_chars=512)
    assert one.prefix == two.prefix == b"x" * 512  # same prefix -> same prefill engine
    chat = parse(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', True)
    assert chat.model == "m" and chat.prompt_tokens >= 1 and not chat.stream


# ----- local choices -----


def test_least_loaded_rotates_among_ties() -> None:
    assert least_loaded([]) == -1
    assert least_loaded([3, 1, 2]) == 1
    assert {least_loaded([0, 5, 0], turn) for turn in range(4)} == {0, 2}


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.binary(min_size=1, max_size=32))
def test_prefill_choice_respects_the_load_bound(inflight: list[int], key: bytes) -> None:
    ids = [f"p{i}" for i in range(len(inflight))]
    order = pick_prefill(key, ids, inflight, 1.25)
    assert sorted(order) == list(range(len(ids)))
    limit = -(-1.25 * (sum(inflight) + 1) // len(ids))
    ranked = rendezvous_order(key, ids)
    under = [i for i in ranked if inflight[i] < limit]
    assert order[0] == (under[0] if under else ranked[0])


def test_prefix_affinity_is_stable_and_spreads_keys() -> None:
    ids = ["p0", "p1", "p2", "p3"]
    firsts = [pick_prefill(f"prefix-{k}".encode(), ids, [0, 0, 0, 0], 1.25)[0] for k in range(400)]
    again = [pick_prefill(f"prefix-{k}".encode(), ids, [0, 0, 0, 0], 1.25)[0] for k in range(400)]
    assert firsts == again
    assert min(collections.Counter(firsts).values()) > 60  # every engine gets a share of the prefixes
    # removing an engine moves only the keys that were on it
    without = [pick_prefill(f"prefix-{k}".encode(), ids[:3], [0, 0, 0], 1.25)[0] for k in range(400)]
    assert all(w == f for w, f in zip(without, firsts, strict=True) if f != 3)
    # a hot engine spills its keys to the next-ranked one
    assert pick_prefill(b"k", ids, [0, 0, 0, 0], 1.25)[0] != pick_prefill(b"k", ids, _hot(ids, b"k"), 1.25)[0]


def _hot(ids: list[str], key: bytes) -> list[int]:
    loads = [0] * len(ids)
    loads[rendezvous_order(key, ids)[0]] = 10
    return loads


# ----- registry -----


def test_engines_leave_after_missed_hellos_and_need_a_base_url() -> None:
    registry = GatewayRegistry(liveness=Liveness(3.0))
    registry.on_hello(hello("a", interval=1.0), now=0.0)
    registry.on_hello(hello("b", role="prefill", interval=2.0), now=0.0)
    registry.on_hello(hello("c", base_url=None), now=0.0)
    assert [e.engine_id for e in registry.live(now=2.9)] == ["a", "b"]
    assert [e.engine_id for e in registry.live("prefill", now=2.9)] == ["b"]
    assert [e.engine_id for e in registry.live(now=3.1)] == ["b"]  # a missed three 1 s hellos
    assert registry.get_live("a", now=3.1) is None
    registry.on_hello(hello("a", interval=1.0), now=4.0)  # says hello again: back
    assert [e.engine_id for e in registry.live(now=4.5)] == ["a", "b"]
    assert registry.models(now=4.5) == ["m"] and registry.models(now=100.0) == []
    registry.forget_dead(now=1000.0, keep_s=10.0)
    assert registry.engines == {}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["dp", "prefill"]),
            st.sampled_from([0.5, 1.0, 2.0]),
            st.floats(0.0, 3.0),  # time to the next event
            st.booleans(),  # a hello (else only a query)
        ),
        max_size=30,
    )
)
def test_the_cached_live_list_is_what_a_fresh_scan_gives(events: list[tuple[str, str, float, float, bool]]) -> None:
    registry, fresh, now = GatewayRegistry(liveness=Liveness(3.0)), GatewayRegistry(liveness=Liveness(3.0)), 0.0
    for engine_id, role, interval, step, says_hello in events:
        now += step
        if says_hello:
            for r in (registry, fresh):
                r.on_hello(hello(engine_id, role=role, interval=interval), now=now)
        fresh._live.clear()  # no cache: every answer a scan
        for role_asked in (None, "dp", "prefill"):
            assert registry.live(role_asked, now=now) == fresh.live(role_asked, now=now)
            assert registry.live(role_asked, "m", now=now) == fresh.live(role_asked, "m", now=now)


def test_an_engine_url_is_parsed_once_and_follows_its_hello() -> None:
    registry = GatewayRegistry()
    registry.on_hello(hello("a", base_url="http://127.0.0.1:1/"), now=0.0)
    engine = registry.engines["a"]
    assert engine.url("/v1/completions") is engine.url("/v1/completions")
    assert str(engine.url("/v1/completions")) == "http://127.0.0.1:1/v1/completions"
    registry.on_hello(hello("a", base_url="http://127.0.0.1:2"), now=1.0)
    assert str(engine.url("/v1/completions")) == "http://127.0.0.1:2/v1/completions"


# ----- signatures -----


def _signature(request_id: str, value: int = 1) -> PrefillSignature:
    return PrefillSignature(
        engine_id="p0", request_id=request_id, ts=0.0, prompt_tokens=3, signature=np.full((2, 4), value, np.uint16)
    )


async def test_signature_box_matches_vllm_request_ids_and_early_arrivals() -> None:
    box = SignatureBox(keep=2)
    rid = new_request_id()
    box.expect(rid)
    waiter = asyncio.ensure_future(box.wait(rid, 5.0))
    await asyncio.sleep(0)
    box.on_signature(_signature(f"cmpl-{rid}-0", 7))  # vLLM's id embeds the X-Request-Id
    assert int((await waiter)[0, 0]) == 7
    assert box.waiting == {}
    early = new_request_id()
    box.on_signature(_signature(early, 3))  # arrives before anyone waits
    assert int((await box.wait(early, 0.0))[0, 0]) == 3
    missing = new_request_id()
    box.expect(missing)
    assert await box.wait(missing, 0.01) is None and box.waiting == {}
    box.on_signature(_signature("not-from-a-gateway"))
    for _ in range(5):
        box.on_signature(_signature(new_request_id()))
    assert len(box.early) == 2  # bounded


async def test_an_engine_without_bus_signatures_is_not_waited_for() -> None:
    box = SignatureBox()
    assert box.wait_for("p0", 0.2) == 0.2
    for _ in range(MISSES_BEFORE_NO_WAIT):
        rid = new_request_id()
        box.expect(rid)
        assert await box.wait(rid, 0.001, "p0") is None
    assert box.wait_for("p0", 0.2) == 0.0 and box.wait_for("p1", 0.2) == 0.2
    rid = new_request_id()
    box.expect(rid)
    box.on_signature(_signature(f"cmpl-{rid}-0"))  # a late signature from p0: it publishes them again
    assert box.wait_for("p0", 0.2) == 0.2
    assert await box.wait(rid, 0.0, "p0") is not None  # an early arrival is used even without waiting


# ----- handoff bodies -----


def test_prefill_and_decode_bodies() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 9}
    prefill = prefill_body(body)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False and "stream_options" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 9 and body["stream"] is True  # the client's body is not modified
    sig = np.arange(8, dtype=np.uint8).reshape(2, 4)
    kv = {"remote_engine_id": "p0", SIGNATURE_KEY: signature_to_json(sig), ENGINE_KEY: "p0"}
    assert np.array_equal(signature_in(kv), sig)
    assert decode_body(body, kv)["kv_transfer_params"] == {"remote_engine_id": "p0"}
    assert decode_body(body, kv)["stream_options"] == {"include_usage": True}
    assert signature_in({SIGNATURE_KEY: {"dtype": "<f4", "shape": [1, 1], "data": ""}}) is None
    assert signature_in({}) is None


# ----- the router's DP rule -----


def _dp_core(rule: str) -> RouterCore:
    core = RouterCore(RouterSettings(dp_rule=rule, inflight_grace_s=0.0))
    for engine_id, running, waiting, prefill in (("a", 0, 4, 0), ("b", 6, 0, 9000)):
        core.on_hello(hello(engine_id), 0.0)
        core.on_telemetry(
            Telemetry(
                engine_id=engine_id,
                seq=1,
                ts=0.0,
                kv_usage=0.1,
                num_running=running,
                num_waiting=waiting,
                waiting_prefill_tokens=prefill,
                remaining_prefill_tokens=0,
                step_time_ema=0.01,
            ),
            0.0,
        )
    return core


def test_router_dp_rule_is_selectable() -> None:
    request = RouteDpRequest(request_id="r", prompt_tokens=10)
    # Gimbal: b holds 9000 prefill tokens of work, a none -> a. vLLM: 4*4 + 0 = 16 for a, 0 + 6 = 6 for b -> b.
    assert _dp_core("gimbal").route_dp(request, 0.0).reply.engine_id == "a"
    assert _dp_core("vllm").route_dp(request, 0.0).reply.engine_id == "b"
    with pytest.raises(ValueError, match="dp_rule"):
        RouterSettings(dp_rule="p2c")


def test_a_busy_port_is_one_plain_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = GatewayService(SwitchyardSettings(), GatewaySettings(port=port))
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            service._listen()


def test_request_ids_are_unique_and_have_the_shape_engines_echo() -> None:
    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == len(ids)
    assert all(REQUEST_ID.fullmatch(i) for i in ids)
