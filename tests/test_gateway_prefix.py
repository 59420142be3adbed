"""The gateway's prefix-cache keys (issue 25): prompt block keys, the prefill choice by the prefix index under the
load bound, KV events from prefill engines, and the settings' errors. Real nats-server, real HTTP, stub engines."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.gateway.choice import pick_prefill, rendezvous_order
from switchyard.services.gateway.prefix import PrefillPrefix
from switchyard.services.gateway.prompt_keys import PromptKeyer, parse_tokenizers
from switchyard.services.gateway.registry import GatewayRegistry
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.errors import ConfigError
from switchyard.shared.prefix_keys import block_keys, text_keys
from switchyard.shared.schemas import (
    MAX_PROMPT_BLOCKS,
    Capacity,
    Hello,
    KvEvents,
    KvOp,
    ModelShape,
    RouteDpRequest,
)
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment, metric, wait_for

BLOCK = 16  # the stub engines' block size (their hellos)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _words(n: int, seed: int = 0) -> str:
    return " ".join(f"t{i}" for i in np.random.default_rng(seed).integers(3, 512, n))


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A word-level tokenizer (one token a word, as tests/vllm_helpers.py builds for vLLM) that adds a BOS token,
    with a chat template and its special tokens in tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {f"t{i}": i for i in range(512)} | {"<s>": 512, "</s>": 513, "<|user|>": 514, "<|assistant|>": 515}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 512)])
    where = tmp_path / "tok"
    where.mkdir()
    tok.save(str(where / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where


def _tok(where: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(where / "tokenizer.json"))


# ----- the pure choice ----------------------------------------------------------------------------------------


def test_prefill_choice_without_cache_is_the_rendezvous_rule() -> None:
    ids = ["p0", "p1", "p2", "p3"]
    for k in range(50):
        key = f"prefix-{k}".encode()
        assert pick_prefill(key, ids, [0, 1, 0, 2], 1.25) == pick_prefill(key, ids, [0, 1, 0, 2], 1.25, [0] * 4)
        assert pick_prefill(key, ids, [0] * 4, 1.25, [0] * 4)[0] == rendezvous_order(key, ids)[0]


def test_prefill_choice_goes_where_the_most_is_cached() -> None:
    ids = ["p0", "p1", "p2", "p3"]
    key = b"a prompt"
    ranked = rendezvous_order(key, ids)
    cached = [0] * 4
    cached[ranked[2]], cached[ranked[3]] = 5, 9
    order = pick_prefill(key, ids, [0] * 4, 1.25, cached)
    # the most cached first; retries: the next most cached, then by rank
    assert order == [ranked[3], ranked[2], ranked[0], ranked[1]]
    cached[ranked[1]] = 9  # a tie: the better-ranked of the two
    assert pick_prefill(key, ids, [0] * 4, 1.25, cached)[0] == ranked[1]


def test_prefill_choice_spills_a_hot_prefix_past_the_load_bound() -> None:
    ids = ["p0", "p1", "p2"]
    key = b"hot"
    ranked = rendezvous_order(key, ids)
    cached = [0] * 3
    cached[ranked[2]], cached[ranked[1]] = 10, 4
    inflight = [0] * 3
    inflight[ranked[2]] = 4  # total 4: limit ceil(1.25 * 5 / 3) = 3, and the holder has 4
    order = pick_prefill(key, ids, inflight, 1.25, cached)
    assert order[0] == ranked[1]  # the next best holder under the bound
    cached[ranked[1]] = 0
    assert pick_prefill(key, ids, inflight, 1.25, cached)[0] == ranked[0]  # nobody else holds it: by rank
    # equal loads are all under the bound (some engine always is: the bound is above the mean): the holder
    assert pick_prefill(key, ids, [9, 9, 9], 1.0, cached)[0] == ranked[2]
    assert pick_prefill(key, [], [], 1.25, []) == []


# ----- prompt keys ----------------------------------------------------------------------------------------------


def test_completion_keys_are_the_tokens_vllm_sees(tokenizer_dir: Path) -> None:
    keyer = PromptKeyer(f"m={tokenizer_dir}", tokenize_all=True)
    tok = _tok(tokenizer_dir)
    prompt = _words(100)
    ids = tok.encode(prompt).ids
    assert ids[0] == 512 and len(ids) == 101  # BOS added, as vLLM's completions default does
    got = keyer.keys_now({"prompt": prompt}, False, "m", BLOCK)
    assert got.kind == "tokens" and got.tokens == 101
    assert np.array_equal(got.keys, block_keys(ids, BLOCK)) and len(got.keys) == 101 // BLOCK
    bare = keyer.keys_now({"prompt": prompt, "add_special_tokens": False}, False, "m", BLOCK)
    assert bare.tokens == 100 and np.array_equal(bare.keys, block_keys(ids[1:], BLOCK))
    # a batch: the first prompt's blocks, every prompt's tokens
    both = keyer.keys_now({"prompt": [prompt, "t1 t2"]}, False, "m", BLOCK)
    assert both.tokens == 101 + 3 and np.array_equal(both.keys, got.keys)
    # the same prompt tokenized off the loop (encode_batch) names the same blocks
    off = asyncio.run(
        PromptKeyer(f"m={tokenizer_dir}", inline_chars=0, tokenize_all=True).keys({"prompt": prompt}, False, "m", BLOCK)
    )
    assert np.array_equal(off.keys, got.keys) and off.tokens == 101


def test_a_long_prompt_in_pieces_is_tokenized_exactly_and_its_pieces_cached(tokenizer_dir: Path) -> None:
    keyer = PromptKeyer(f"m={tokenizer_dir}", inline_chars=0, piece_chars=64, tokenize_all=True)
    model = keyer.tokenizers["m"]
    assert model.pieces  # the check at load: cut texts tokenize as the whole
    tok = _tok(tokenizer_dir)
    shared = _words(300, 1)
    for tail in (_words(50, 2), _words(70, 3)):
        prompt = f"{shared} {tail}"
        got = asyncio.run(keyer.keys({"prompt": prompt}, False, "m", BLOCK))
        assert np.array_equal(got.keys, block_keys(tok.encode(prompt).ids, BLOCK))
    # the second prompt's pieces up to where it departs from the first came from the cache
    assert model.cache_hits >= len(shared) // 64 - 2 and model.cache_misses > 0
    # a tokenizer that tokenizes a cut text otherwise (no pre-tokenizer: the whole text is one word) is never cut
    from tokenizers import Tokenizer, models

    whole = Tokenizer(models.WordLevel(vocab={"t0": 0, "t1 t2": 1}, unk_token="t0"))
    whole.save(str(tokenizer_dir / "whole.json"))
    assert not PromptKeyer(f"w={tokenizer_dir / 'whole.json'}").tokenizers["w"].pieces


def test_only_the_text_seen_before_is_tokenized(tokenizer_dir: Path) -> None:
    """By default a prompt is tokenized only as far as prompts this gateway was sent began the same way: its keys
    are then the leading keys of the whole prompt's; a prompt like none before gets none (nothing can match)."""
    keyer = PromptKeyer(f"m={tokenizer_dir}", piece_chars=64)
    tok = _tok(tokenizer_dir)
    shared = _words(400, 1)
    first = f"{shared} {_words(100, 2)}"
    assert len(keyer.keys_now({"prompt": first}, False, "m", BLOCK).keys) == 0  # never seen: not tokenized
    again = keyer.keys_now({"prompt": first}, False, "m", BLOCK)  # all seen: all tokenized, the exact count
    ids = tok.encode(first).ids
    assert again.tokens == len(ids) and np.array_equal(again.keys, block_keys(ids, BLOCK))
    other = f"{shared} {_words(100, 3)}"  # the shared part seen: its leading keys, no exact count
    got = keyer.keys_now({"prompt": other}, False, "m", BLOCK)
    whole = block_keys(tok.encode(other).ids, BLOCK)
    assert got.tokens is None and 0 < len(got.keys) < len(whole)
    assert np.array_equal(got.keys, whole[: len(got.keys)])
    assert len(got.keys) * BLOCK * 5 >= len(shared) - 3 * 256  # up to a cut within the last seen blocks
    # the same seen prefix again, another tail: its keys are remembered, not tokenized again
    assert keyer.keys_now({"prompt": f"{shared} {_words(90, 4)}"}, False, "m", BLOCK) is got
    # chat: the rendered text is what is seen
    chat = {"messages": [{"role": "user", "content": shared}]}
    assert len(keyer.keys_now(chat, True, "m", BLOCK).keys) == 0
    rendered = tok.encode(f"<s><|user|> {shared} <|assistant|>", add_special_tokens=False).ids
    assert np.array_equal(keyer.keys_now(chat, True, "m", BLOCK).keys, block_keys(rendered, BLOCK))


def test_token_id_prompts_need_no_tokenizer() -> None:
    keyer = PromptKeyer()
    ids = list(range(40))
    got = keyer.keys_now({"prompt": ids}, False, "any", BLOCK)
    assert got.kind == "tokens" and got.tokens == 40 and np.array_equal(got.keys, block_keys(ids, BLOCK))
    batch = keyer.keys_now({"prompt": [ids, ids[:5]]}, False, "any", BLOCK)
    assert batch.tokens == 45 and np.array_equal(batch.keys, got.keys)


def test_chat_keys_render_the_template(tokenizer_dir: Path) -> None:
    keyer = PromptKeyer(f"m={tokenizer_dir}", tokenize_all=True)
    tok = _tok(tokenizer_dir)
    messages = [{"role": "user", "content": _words(60)}]
    rendered = f"<s><|user|> {messages[0]['content']} <|assistant|>"
    ids = tok.encode(rendered, add_special_tokens=False).ids  # the template has the BOS: vLLM adds none for chat
    assert ids[0] == 512 and ids[-1] == 515
    got = keyer.keys_now({"messages": messages}, True, "m", BLOCK)
    assert got.kind == "tokens" and got.tokens == len(ids) and np.array_equal(got.keys, block_keys(ids, BLOCK))
    parts = [{"role": "user", "content": [{"type": "text", "text": messages[0]["content"]}]}]
    assert np.array_equal(keyer.keys_now({"messages": parts}, True, "m", BLOCK).keys, got.keys)
    no_prompt = keyer.keys_now({"messages": messages, "add_generation_prompt": False}, True, "m", BLOCK)
    assert no_prompt.tokens == len(ids) - 1
    # what this gateway cannot render as the engine will: text keys over the messages
    compact = json.dumps(messages, separators=(",", ":"))
    for body in (
        {"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": messages, "chat_template": "{{ messages }}"},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ):
        assert keyer.keys_now(body, True, "m", BLOCK).kind == "text"
    text = keyer.keys_now({"messages": messages, "tools": [{}]}, True, "m", BLOCK)
    assert np.array_equal(text.keys, text_keys(compact, BLOCK * 4)) and text.tokens is None


def test_without_a_tokenizer_keys_are_text_and_capped(tokenizer_dir: Path) -> None:
    keyer = PromptKeyer(f"m={tokenizer_dir}", tokenize_all=True)
    prompt = _words(100)
    got = keyer.keys_now({"prompt": prompt}, False, "other-model", BLOCK)
    assert got.kind == "text" and got.tokens is None and np.array_equal(got.keys, text_keys(prompt, 64))
    huge = list(range(MAX_PROMPT_BLOCKS * 2 + 3))
    assert len(keyer.keys_now({"prompt": huge}, False, "m", 2).keys) == MAX_PROMPT_BLOCKS
    assert len(keyer.keys_now({"prompt": "x" * (MAX_PROMPT_BLOCKS * 8 + 9)}, False, None, 1).keys) == MAX_PROMPT_BLOCKS


def test_tokenizer_setting_errors(tmp_path: Path, tokenizer_dir: Path) -> None:
    assert parse_tokenizers(" a=/x , b=/y ,") == {"a": "/x", "b": "/y"}
    with pytest.raises(ConfigError, match="'a' is not model=path"):
        parse_tokenizers("a")
    with pytest.raises(ConfigError, match="no tokenizer for model 'm' at '/nonexistent'"):
        PromptKeyer("m=/nonexistent")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="is not a tokenizer"):
        PromptKeyer(f"m={bad}")
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ConfigError, match="chat template"):
        PromptKeyer(f"m={tokenizer_dir}", tokenize_all=True)


def test_a_bad_tokenizer_path_is_one_line_at_startup(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env |= {
        "SWITCHYARD_GATEWAY_TOKENIZERS": "stub-model=/nonexistent/tokenizer",
        "SWITCHYARD_NATS_INITIAL_CONNECT_S": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "switchyard.cli", "gateway", "--nats-url", "nats://127.0.0.1:1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no tokenizer for model 'stub-model' at '/nonexistent/tokenizer'" in lines[0], lines


# ----- KV events from prefill engines ---------------------------------------------------------------------------


def _hello(engine_id: str, role: str, block_size: int = BLOCK) -> Hello:
    return Hello(
        engine_id=engine_id,
        role=role,
        model=ModelShape(name="m", num_layers=2, num_experts=4, top_k=2),
        ep_group=engine_id,
        gpus=[],
        capacity=Capacity(max_running=8, kv_blocks=100, block_size=block_size),
        ts=0.0,
        agent="stub",
        base_url="http://127.0.0.1:1",
    )


def _kv(engine_id: str, seq: int, *ops: tuple[str, list[int]], block_size: int = BLOCK) -> KvEvents:
    return KvEvents(
        engine_id=engine_id,
        seq=seq,
        ts=0.0,
        block_size=block_size,
        ops=[KvOp(kind=k, keys=np.array(keys, dtype=np.uint64)) for k, keys in ops],
    )


def test_kv_events_are_applied_only_from_known_prefill_engines() -> None:
    registry = GatewayRegistry()
    for engine_id, role in (("p0", "prefill"), ("d0", "decode"), ("p1", "prefill")):
        registry.on_hello(_hello(engine_id, role))
    prefix = PrefillPrefix(registry)
    outcomes = ("unknown_engine", "not_prefill", "block_size")
    outcome = {o: metric("switchyard_gateway_kv_events_total", outcome=o) for o in outcomes}
    keys = [11, 12, 13]
    prefix.on_kv(_kv("ghost", 0, ("stored", keys)))
    prefix.on_kv(_kv("d0", 0, ("stored", keys)))
    prefix.on_kv(_kv("p1", 0, ("stored", keys), block_size=32))
    assert len(prefix.blocks) == 0 and not prefix.reports("p1")
    assert metric("switchyard_gateway_kv_events_total", outcome="unknown_engine") == outcome["unknown_engine"] + 1
    assert metric("switchyard_gateway_kv_events_total", outcome="not_prefill") == outcome["not_prefill"] + 1
    assert metric("switchyard_gateway_kv_events_total", outcome="block_size") == outcome["block_size"] + 1
    engines = [registry.engines["p0"], registry.engines["p1"]]
    prefix.on_kv(_kv("p0", 0, ("stored", keys)))
    assert prefix.cached(np.array(keys, dtype=np.uint64), "tokens", engines, 0.0) == [3, 0]
    prefix.on_kv(_kv("p0", 1, ("removed", [13])))
    assert prefix.cached(np.array(keys, dtype=np.uint64), "tokens", engines, 0.0) == [2, 0]
    prefix.on_kv(_kv("p0", 5, ("stored", [99])))  # events 2-4 lost: what it held is unknown now
    assert prefix.cached(np.array(keys, dtype=np.uint64), "tokens", engines, 0.0) == [0, 0]
    # an engine that sends no events: what the gateway routed there; text keys: always that
    prefix.chosen("p1", np.array(keys, dtype=np.uint64), "tokens", 0.0)
    prefix.chosen("p0", np.array([7, 8], dtype=np.uint64), "text", 0.0)
    assert prefix.cached(np.array(keys, dtype=np.uint64), "tokens", engines, 1.0) == [0, 3]
    assert prefix.cached(np.array([7, 8], dtype=np.uint64), "text", engines, 1.0) == [2, 0]
    prefix.forget("p1")
    assert prefix.cached(np.array(keys, dtype=np.uint64), "tokens", engines, 1.0) == [0, 0]


# ----- end to end -------------------------------------------------------------------------------------------------


async def test_kv_events_draw_a_repeated_prompt_and_the_load_bound_spills_it(
    bus: Bus, settings: SwitchyardSettings, tokenizer_dir: Path
) -> None:
    """Two prefill stubs on a real nats-server: the one whose KV events hold a long prompt's blocks gets it, though
    the rendezvous hash ranks the other first; while it has too many in flight, the prompt spills to the other."""
    tok = _tok(tokenizer_dir)
    seed = next(s for s in range(100) if rendezvous_order(_words(300, s)[:512].encode(), ["p0", "p1"])[0] == 0)
    prompt = _words(300, seed)  # ranked p0 first by the hash
    keys = block_keys(tok.encode(prompt).ids, BLOCK)
    stubs = [
        StubConfig("p0", role="prefill"),
        StubConfig("p1", role="prefill", prefill_delay_s=0.6),
        StubConfig("d0", role="decode"),
    ]
    gateway = GatewaySettings(
        port=0, route_timeout_s=0.5, signature_wait_s=0.0, tokenizers=f"stub-model={tokenizer_dir}", tokenize_all=True
    )
    body = {"model": "stub-model", "prompt": prompt, "max_tokens": 2}
    async with (
        deployment(settings, bus, stubs, gateway=gateway, router=False) as (gw, engines),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
    ):
        kv_subject = bus.subjects.kv_events("p1")
        await bus.publish(kv_subject, _kv("p1", 0, ("stored", keys[: len(keys) // 2].tolist())))
        await bus.publish(kv_subject, _kv("p1", 1, ("stored", keys[len(keys) // 2 :].tolist())))
        await wait_for(lambda: gw.prefix is not None and gw.prefix.blocks.blocks("p1") == len(keys))
        answer = await client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert len(engines["p1"].received) == 1 and not engines["p0"].received
        # three at once: p1 takes two (limit ceil(1.25 * 2 / 2) = 2 after the first), the third spills to p0
        started = []
        for n in (1, 2):
            started.append(asyncio.create_task(client.post("/v1/completions", json=body)))
            await wait_for(lambda n=n: gw.registry.engines["p1"].inflight == n)
        started.append(asyncio.create_task(client.post("/v1/completions", json=body)))
        answers = await asyncio.gather(*started)
    assert all(a.status_code == 200 for a in answers)
    assert len(engines["p1"].received) == 3 and len(engines["p0"].received) == 1


async def test_dp_route_requests_carry_the_prompts_token_keys(
    bus: Bus, settings: SwitchyardSettings, tokenizer_dir: Path
) -> None:
    asked: list[RouteDpRequest] = []

    async def on_route(msg: object) -> None:
        asked.append(decode(msg.data, RouteDpRequest))  # type: ignore[attr-defined]

    await bus.nc.subscribe(bus.subjects.route_dp, cb=on_route)  # a copy of every question the router gets
    tok = _tok(tokenizer_dir)
    prompt = _words(200)
    gateway = GatewaySettings(port=0, route_timeout_s=0.5, tokenizers=f"stub-model={tokenizer_dir}", tokenize_all=True)
    async with (
        deployment(settings, bus, [StubConfig("a"), StubConfig("b")], gateway=gateway) as (gw, _engines),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
    ):
        answer = await client.post("/v1/completions", json={"model": "stub-model", "prompt": prompt, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        chat = {"model": "stub-model", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
        answer = await client.post("/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        await wait_for(lambda: len(asked) == 2)
    ids = tok.encode(prompt).ids
    assert asked[0].key_kind == "tokens" and asked[0].prompt_tokens == len(ids)
    assert np.array_equal(asked[0].block_keys, block_keys(ids, BLOCK))
    chat_ids = tok.encode(f"<s><|user|> {prompt} <|assistant|>", add_special_tokens=False).ids
    assert asked[1].prompt_tokens == len(chat_ids) and np.array_equal(asked[1].block_keys, block_keys(chat_ids, BLOCK))


async def test_a_long_prompt_tokenizing_does_not_stall_the_event_loop(
    bus: Bus, settings: SwitchyardSettings, tokenizer_dir: Path
) -> None:
    """A short request is answered while a long prompt is being tokenized (in a worker thread): had the
    tokenization run on the event loop, nothing else could be read, routed or answered until it ended."""
    gateway = GatewaySettings(port=0, route_timeout_s=0.5, tokenizers=f"stub-model={tokenizer_dir}", tokenize_all=True)
    long_prompt = _words(400_000)
    async with (
        deployment(settings, bus, [StubConfig("a")], gateway=gateway) as (gw, _engines),
        httpx.AsyncClient(base_url=gw.url, timeout=60) as client,
    ):
        assert gw.keyer is not None
        model = gw.keyer.tokenizers["stub-model"]
        tokenizing, finish = threading.Event(), model.finish
        finished: list[float] = []

        def watched(looked, special, suffix=True):  # records when the long prompt's tokenization starts and ends
            if looked.missing > 100_000:
                tokenizing.set()
                try:
                    return finish(looked, special, suffix)
                finally:
                    finished.append(time.perf_counter())
            return finish(looked, special, suffix)

        model.finish = watched
        long = asyncio.create_task(client.post("/v1/completions", json={"model": "stub-model", "prompt": long_prompt}))
        assert await asyncio.to_thread(tokenizing.wait, 30)
        short = await client.post("/v1/completions", json={"model": "stub-model", "prompt": "t1 t2 t3"})
        short_done = time.perf_counter()
        assert short.status_code == 200
        assert (await long).status_code == 200
    assert finished and short_done < finished[0]  # answered while the long prompt was still tokenizing


async def test_by_default_a_prompt_gets_keys_once_the_gateway_has_seen_it(
    bus: Bus, settings: SwitchyardSettings, tokenizer_dir: Path
) -> None:
    asked: list[RouteDpRequest] = []

    async def on_route(msg: object) -> None:
        asked.append(decode(msg.data, RouteDpRequest))  # type: ignore[attr-defined]

    await bus.nc.subscribe(bus.subjects.route_dp, cb=on_route)
    prompt = _words(300)
    gateway = GatewaySettings(port=0, route_timeout_s=0.5, tokenizers=f"stub-model={tokenizer_dir}")
    async with (
        deployment(settings, bus, [StubConfig("a")], gateway=gateway) as (gw, _engines),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
    ):
        for _ in range(2):
            answer = await client.post("/v1/completions", json={"model": "stub-model", "prompt": prompt})
            assert answer.status_code == 200, answer.text
        await wait_for(lambda: len(asked) == 2)
    ids = _tok(tokenizer_dir).encode(prompt).ids
    assert asked[0].block_keys is None and asked[0].prompt_tokens == len(prompt) // 4  # unseen: the estimate
    assert np.array_equal(asked[1].block_keys, block_keys(ids, BLOCK)) and asked[1].prompt_tokens == len(ids)
