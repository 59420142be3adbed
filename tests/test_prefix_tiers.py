"""Cache tiers in the precise prefix index (`solver.routing.prefix.tiers`, `BlockIndex.credit`): pure.

A block an engine holds in an offload tier (CPU, disk; the KV message's `KvOp.tier`) is credited at its tier's
weight; a block in two tiers counts once at its best; weights (1, 0, 0) give exactly the GPU-only match; each
tier is bounded per engine like the GPU one; clears, removals and forgets reach every tier; the wire refuses
unknown tiers (counted by the bus as any malformed message).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from switchyard.services.gateway.prefix import PrefillPrefix
from switchyard.services.gateway.registry import GatewayRegistry
from switchyard.services.router.prefix import PrefixState
from switchyard.shared.codec import WireError, decode, encode
from switchyard.shared.schemas import Capacity, Hello, KvEvents, KvOp, ModelShape
from switchyard.solver.routing.prefix import DEFAULT_WEIGHTS, GPU_ONLY, BlockIndex, KvApplier, TierWeights
from switchyard.solver.routing.prefix.tiers import walk_tiers

KEYS = list(range(100, 110))


def _credit(index: BlockIndex, engines: list[str], weights: TierWeights = DEFAULT_WEIGHTS) -> tuple[list, list]:
    depth, credit = index.credit(KEYS, tuple(engines), weights)
    return depth.tolist(), credit.tolist()


def test_defaults_are_dynamos_and_bounded() -> None:
    assert tuple(DEFAULT_WEIGHTS) == (1.0, 0.75, 0.25)
    with pytest.raises(ValueError, match="tier weights"):
        TierWeights(1.0, 1.5, 0.0).check()


def test_offload_tiers_extend_the_gpu_prefix_at_their_weights() -> None:
    index = BlockIndex()
    index.stored("a", KEYS[:4])  # GPU: blocks 0-3
    index.stored("a", KEYS[:7], tier="cpu")  # CPU: 0-6 (0-3 also on GPU: counted once, at GPU's weight)
    index.stored("a", KEYS[7:9], tier="disk")  # disk: 7-8
    index.stored("b", KEYS[:2])
    index.stored("c", KEYS[:10], tier="disk")
    depth, credit = _credit(index, ["a", "b", "c", "nobody"])
    assert depth == [9, 2, 10, 0]
    assert credit == pytest.approx([4 + 3 * 0.75 + 2 * 0.25, 2.0, 10 * 0.25, 0.0])
    assert index.match(KEYS, ["a", "b", "c"]).tolist() == [4, 2, 0]  # `match` stays the GPU tier's


def test_gpu_only_weights_are_exactly_the_gpu_match() -> None:
    """The control: with the offload tiers weighted 0, nothing they hold is credited, nor walked through."""
    index = BlockIndex()
    index.stored("a", KEYS[:3])
    index.stored("a", KEYS[3:6], tier="cpu")
    index.stored("a", KEYS[6:10])  # GPU blocks past a CPU-only run: reachable only through it
    depth, credit = _credit(index, ["a"], GPU_ONLY)
    assert depth == [3] and credit == [3.0]
    depth, credit = _credit(index, ["a"])
    assert depth == [10] and credit == pytest.approx([3 + 3 * 0.75 + 4])


def test_removals_and_clears_per_tier() -> None:
    index = BlockIndex()
    index.stored("a", KEYS[:5])
    index.stored("a", KEYS[:5], tier="cpu")
    index.removed("a", KEYS[2:5], tier="gpu")  # evicted from GPU, still in CPU
    assert _credit(index, ["a"]) == ([5], [pytest.approx(2 + 3 * 0.75)])
    index.removed("a", KEYS[4:5], tier="cpu")
    assert _credit(index, ["a"])[0] == [4]
    assert index.blocks("a", "gpu") == 2 and index.blocks("a", "cpu") == 4 and index.blocks("a") == 6
    index.removed("a", KEYS[:1])  # no tier named: from every tier (a contradicted claim)
    assert _credit(index, ["a"])[0] == [0] and index.blocks("a") == 4
    index.cleared("a")
    assert index.blocks("a") == 0 and index.held() == 0
    index.stored("a", KEYS, tier="disk")
    assert index.holds(KEYS[0], ("a",))
    index.forget("a")
    assert index.held() == 0 and index.engines() == [] and not index.holds(KEYS[0], ("a",))


def test_an_offload_tier_is_bounded_per_engine() -> None:
    """A CPU-tier claim cannot grow memory past `max_blocks` per engine (the hello's kv_blocks bounds only GPU)."""
    index = BlockIndex(max_blocks=8)
    index.stored("a", range(1000, 1100), capacity=4, tier="cpu")  # capacity is the GPU's: not this tier's bound
    assert index.blocks("a", "cpu") == 8 and index.dropped_over_cap == 92
    index.stored("a", range(2000, 2100), capacity=4)
    assert index.blocks("a", "gpu") == 4 and index.held() == 12
    depth, _ = index.credit(list(range(1092, 1100)), ("a",))
    assert depth.tolist() == [8]  # the newest 8 are kept, oldest out first


def test_the_applier_follows_each_ops_tier() -> None:
    index = BlockIndex()
    applier = KvApplier(index)
    keys = np.array(KEYS, dtype=np.uint64)

    def events(seq: int, *ops: KvOp) -> KvEvents:
        return KvEvents(engine_id="a", seq=seq, ts=0.0, block_size=16, ops=list(ops))

    applier.apply(events(0, KvOp(kind="stored", keys=keys[:3]), KvOp(kind="stored", keys=keys[:8], tier="cpu")))
    assert _credit(index, ["a"]) == ([8], [pytest.approx(3 + 5 * 0.75)])
    applier.apply(events(1, KvOp(kind="removed", keys=keys[:8], tier="cpu")))
    assert _credit(index, ["a"]) == ([3], [3.0])
    applier.apply(events(2, KvOp(kind="stored", keys=keys, tier="disk"), KvOp(kind="cleared", keys=keys[:0])))
    assert index.held() == 0
    applier.apply(events(3, KvOp(kind="stored", keys=keys, tier="disk")))
    applier.apply(events(5, KvOp(kind="stored", keys=keys[:1])))  # a gap: every tier cleared first
    assert index.blocks("a", "disk") == 0 and index.blocks("a", "gpu") == 1


def test_the_wire_keeps_the_tier_absent_is_gpu_and_unknown_is_refused() -> None:
    keys = np.arange(3, dtype=np.uint64)
    message = KvEvents(
        engine_id="a", seq=0, ts=0.0, block_size=16,
        ops=[KvOp(kind="stored", keys=keys, tier="cpu"), KvOp(kind="stored", keys=keys)],
    )  # fmt: skip
    back = decode(encode(message), KvEvents)
    assert [op.tier for op in back.ops] == ["cpu", None]
    raw = encode(message).replace(b"\xa3cpu", b"\xa3tpu")
    with pytest.raises(WireError) as refused:
        decode(raw, KvEvents)
    assert "tier" in str(refused.value)
    with pytest.raises(ValueError, match="no tier"):
        KvOp(kind="cleared", keys=keys[:0], tier="cpu")


class _Ask(NamedTuple):
    """The fields of a DP route request the router's prefix state reads (`services.router.ask.DpAsk`)."""

    block_keys: np.ndarray
    prompt_tokens: int
    request_id: str = "r1"
    model: str | None = None
    key_kind: str = "tokens"
    progress: bool = False
    reporter: str | None = None


def test_the_router_turns_tier_credit_into_cached_tokens() -> None:
    """Engine a holds 4 blocks on GPU and 4 more on CPU, engine b 6 on GPU: with tier credit a looks better
    (4 + 3 = 7 blocks), with GPU-only weights b does (the control)."""
    keys = np.arange(1, 11, dtype=np.uint64)
    a = [KvOp(kind="stored", keys=keys[:4]), KvOp(kind="stored", keys=keys[:8], tier="cpu")]
    b = [KvOp(kind="stored", keys=keys[:6])]
    ask = _Ask(block_keys=keys, prompt_tokens=10 * 16 + 5)
    got = {}
    for name, weights in (("tiers", DEFAULT_WEIGHTS), ("gpu-only", GPU_ONLY)):
        state = PrefixState("precise", 1000, 1000, 60.0, weights=weights)
        for engine, ops in (("a", a), ("b", b)):
            assert state.apply(KvEvents(engine_id=engine, seq=0, ts=0.0, block_size=16, ops=ops), capacity=100)
        assert not state.fresh(ask, ("a", "b"))
        got[name] = state.cached(ask, ("a", "b"), np.array([16, 16]), 0.0).tolist()
    assert got == {"tiers": [(4 + 4 * 0.75) * 16, 6 * 16], "gpu-only": [4 * 16, 6 * 16]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_matrix_walk_and_the_python_walk_agree(seed: int) -> None:
    """Slots below 64 take the numpy walk, others the per-key one: the same random holdings give the same answer
    either way (engine slots shifted by 60 force the second)."""
    rng = np.random.default_rng(seed)
    keys, engines = list(range(30)), [f"e{i}" for i in range(10)]
    held = rng.random((3, len(keys), len(engines))) < np.array([0.5, 0.7, 0.6])[:, None, None]
    weights = (1.0, 0.75, 0.25)
    answers = []
    for shift in (0, 60):
        slots = {e: i + shift for i, e in enumerate(engines)}
        tiers = []
        for t in range(3):
            holders = {k: sum(1 << (i + shift) for i in range(len(engines)) if held[t, k, i]) for k in keys}
            tiers.append((weights[t], holders, slots))
        start = np.array([int(np.argmin(np.r_[held[0, :, i], False])) for i in range(len(engines))])
        depth, extra = walk_tiers(keys, engines, start, tiers)
        answers.append((depth.tolist(), extra.round(9).tolist()))
    assert answers[0] == answers[1]
    any_tier = held.any(axis=0)
    assert answers[0][0] == [int(np.argmin(np.r_[any_tier[:, i], False])) for i in range(len(engines))]


def test_the_gateways_prefill_choice_credits_tiers_too() -> None:
    """The in-process gateway's prefill index (`services.gateway.prefix`) weighs a CPU-tier block at 0.75."""
    registry = GatewayRegistry()
    for engine_id in ("p0", "p1"):
        registry.on_hello(
            Hello(
                engine_id=engine_id, role="prefill", model=ModelShape(name="m", num_layers=2, num_experts=4, top_k=2),
                ep_group=engine_id, gpus=[], capacity=Capacity(max_running=8, kv_blocks=100, block_size=16), ts=0.0,
                agent="stub", base_url="http://127.0.0.1:1",
            )
        )  # fmt: skip
    prefix = PrefillPrefix(registry)
    keys = np.arange(1, 7, dtype=np.uint64)
    ops = {"p0": [KvOp(kind="stored", keys=keys[:2]), KvOp(kind="stored", keys=keys, tier="cpu")]}
    ops["p1"] = [KvOp(kind="stored", keys=keys[:4])]
    for engine_id, engine_ops in ops.items():
        prefix.on_kv(KvEvents(engine_id=engine_id, seq=0, ts=0.0, block_size=16, ops=engine_ops))
    engines = [registry.engines["p0"], registry.engines["p1"]]
    assert prefix.cached(keys, "tokens", engines, 0.0) == [2 + 4 * 0.75, 4.0]
