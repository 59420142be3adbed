"""The prefix indexes (`solver.routing.prefix`) against brute-force models, their bounds, and the block keys
(`shared.prefix_keys`) they are fed."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.shared.prefix_keys import block_keys, text_keys
from switchyard.solver.routing.prefix import BlockIndex, RoutedIndex
from switchyard.solver.routing.prefix.matching import MatchPlan, leading_matches

ENGINES = ("a", "b", "c", "d")
ASKED = ("a", "b", "c", "d", "never-heard")
keys_st = st.lists(st.integers(0, 12), max_size=8)
engine_st = st.sampled_from(ENGINES)
op_st = st.one_of(
    st.tuples(st.just("stored"), engine_st, keys_st),
    st.tuples(st.just("removed"), engine_st, keys_st),
    st.tuples(st.just("cleared"), engine_st, st.just([])),
    st.tuples(st.just("forget"), engine_st, st.just([])),
)


def leading(held: set[int] | OrderedDict | list, keys: list[int]) -> int:
    depth = 0
    for key in keys:
        if key not in held:
            break
        depth += 1
    return depth


class BlockModel:
    """Each engine's held keys, oldest first; past `cap` the oldest goes (the index's contract)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[str, list[int]] = {}

    def apply(self, op: str, engine: str, keys: list[int]) -> None:
        held = self.held.setdefault(engine, [])
        if op == "stored":
            for key in keys:
                if key not in held:
                    held.append(key)
                    if len(held) > self.cap:
                        held.pop(0)
        elif op == "removed":
            self.held[engine] = [k for k in held if k not in set(keys)]
        else:  # cleared, forget
            self.held[engine] = []

    def match(self, keys: list[int], engines: tuple[str, ...]) -> list[int]:
        return [leading(self.held.get(e, []), keys) for e in engines]


def apply(index: BlockIndex, op: str, engine: str, keys: list[int]) -> None:
    if op == "stored":
        index.stored(engine, np.asarray(keys, dtype=np.uint64) if len(keys) % 2 else keys)  # arrays and lists
    elif op == "removed":
        index.removed(engine, keys)
    elif op == "cleared":
        index.cleared(engine)
    else:
        index.forget(engine)


def check_consistent(index: BlockIndex, model: BlockModel) -> None:
    union: set[int] = set()
    for engine in ENGINES:
        held = model.held.get(engine, [])
        union |= set(held)
        assert index.blocks(engine) == len(held)
    assert len(index) == len(union)
    assert all(mask for mask in index.holders.values()), "no key is left held by nobody"
    assert set(index.holders) == union


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op_st, max_size=40), queries=st.lists(keys_st, min_size=1, max_size=4))
def test_block_index_matches_the_brute_force_model(ops: list, queries: list[list[int]]) -> None:
    index, model = BlockIndex(max_blocks=1000), BlockModel(1000)
    for op in ops:
        apply(index, *op)
        model.apply(*op)
        check_consistent(index, model)
    for keys in queries:
        assert index.match(keys, ASKED).tolist() == model.match(keys, ASKED)
        assert index.match(np.asarray(keys, dtype=np.uint64), ASKED).tolist() == model.match(keys, ASKED)
        assert index.match(keys, ASKED[::-1]).tolist() == model.match(keys, ASKED[::-1])


@settings(max_examples=300, deadline=None)
@given(
    cap=st.integers(1, 5),
    ops=st.lists(op_st.filter(lambda op: op[0] != "removed"), max_size=40),
    queries=st.lists(keys_st, min_size=1, max_size=3),
)
def test_bounded_block_index_drops_the_oldest_first(cap: int, ops: list, queries: list[list[int]]) -> None:
    """Without removals the bound is exact: past `cap`, each engine's oldest stored key goes first."""
    index, model = BlockIndex(max_blocks=cap), BlockModel(cap)
    for op in ops:
        apply(index, *op)
        model.apply(*op)
        check_consistent(index, model)
    for keys in queries:
        assert index.match(keys, ASKED).tolist() == model.match(keys, ASKED)


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(1, 5), ops=st.lists(op_st, max_size=60), queries=st.lists(keys_st, min_size=1, max_size=3))
def test_bounded_block_index_with_removals_stays_within_its_bound_and_its_events(
    cap: int, ops: list, queries: list[list[int]]
) -> None:
    """With removals (a key removed, then stored again, may be dropped over the bound before a younger one:
    the module's documented approximation) the index still holds only keys the engine stored and did not
    remove or clear since, never more than `cap` of them, and answers as its own contents say."""
    index, unbounded = BlockIndex(max_blocks=cap), BlockModel(10**6)
    for op in ops:
        apply(index, *op)
        unbounded.apply(*op)
        for engine in ENGINES:
            slot = index._slot.get(engine)
            mine = set() if slot is None else {k for k, m in index.holders.items() if m >> slot & 1}
            assert len(mine) == index.blocks(engine) <= cap
            assert mine <= set(unbounded.held.get(engine, []))
    for keys in queries:
        for engine, got in zip(ASKED, index.match(keys, ASKED).tolist(), strict=True):
            slot = index._slot.get(engine)
            mine = set() if slot is None else {k for k, m in index.holders.items() if m >> slot & 1}
            assert got == leading(mine, keys)


def test_a_hostile_engine_stays_within_its_share() -> None:
    index = BlockIndex(max_blocks=1000)
    good = np.arange(1, 501, dtype=np.uint64)
    index.stored("good", good)
    flood = np.arange(10_000, 20_000, dtype=np.uint64)  # 10 x max_blocks
    for start in range(0, len(flood), 16):
        index.stored("evil", flood[start : start + 16])
    index.stored("evil", good)  # the good engine's blocks too: they count against evil's share only
    assert index.blocks("evil") == 1000 and index.blocks("good") == 500
    assert index.match(good, ("good", "evil")).tolist() == [500, 500]
    assert len(index) == 500 + 500  # evil: good's 500 and its newest 500 of the flood
    assert index.match(flood[-500:], ("evil",)).tolist() == [500]
    assert index.match(flood[:9500], ("evil",)).tolist() == [0]
    assert index.dropped_over_cap == 10_000 + 500 - 1000
    index.forget("evil")
    assert index.match(good, ("good", "evil")).tolist() == [500, 0] and len(index) == 500


def test_oldest_out_order_and_restore() -> None:
    index = BlockIndex(max_blocks=3)
    index.stored("e", [1, 2, 3])
    index.stored("e", [2])  # stored again while held: keeps its place
    index.stored("e", [4])  # drops 1, the oldest
    assert index.match([2, 3, 4], ("e",)).tolist() == [3] and index.match([1], ("e",)).tolist() == [0]
    index.stored("e", [5])  # drops 2
    assert index.match([3, 4, 5], ("e",)).tolist() == [3] and index.blocks("e") == 3
    index.cleared("e")
    assert index.blocks("e") == 0 and len(index) == 0
    index.stored("e", [7, 8])
    assert index.match([7, 8, 9], ("e",)).tolist() == [2]


def test_the_ring_compacts_and_grows_under_churn() -> None:
    """Many stores and removals of one engine: the ring compacts stale entries and the counts stay exact."""
    index = BlockIndex(max_blocks=100)
    rng = np.random.default_rng(0)
    model = BlockModel(100)
    for _ in range(3000):
        keys = rng.integers(0, 300, 4).tolist()
        op = "stored" if rng.random() < 0.6 else "removed"
        apply(index, op, "e", keys)
        model.apply(op, "e", keys)
        assert index.blocks("e") <= 100
    assert len(index._engines[index._slot["e"]].ring) <= 2 * 100 + 16


def test_slots_are_reused_and_the_match_plan_follows() -> None:
    index = BlockIndex()
    engines = ("a", "b")
    index.stored("a", [1, 2])
    assert index.match([1, 2], engines).tolist() == [2, 0]
    index.stored("b", [1])
    assert index.match([1, 2], engines).tolist() == [2, 1]  # the same tuple: the plan was rebuilt for b's slot
    index.forget("a")
    index.stored("c", [1, 2, 3])  # takes a's old slot: a must not see c's blocks
    assert index.match([1, 2, 3], ("a", "b", "c")).tolist() == [0, 1, 3]


@pytest.mark.parametrize("engines", [1, 3, 64, 70, 130])
def test_leading_matches_over_many_slots(engines: int) -> None:
    rng = np.random.default_rng(engines)
    keys = list(range(100, 140))
    depth = rng.integers(0, 41, engines)
    holders: dict[int, int] = {}
    for slot, d in enumerate(depth):
        for key in keys[:d]:
            holders[key] = holders.get(key, 0) | 1 << slot
    slots = [*range(engines), -1]
    assert leading_matches(holders, keys, slots).tolist() == [*depth.tolist(), 0]
    assert leading_matches(holders, np.asarray(keys), MatchPlan(slots)).tolist() == [*depth.tolist(), 0]
    assert leading_matches(holders, [], slots).tolist() == [0] * (engines + 1)


# -- RoutedIndex ------------------------------------------------------------------------------------------------


class RoutedModel:
    def __init__(self, cap: int, ttl: float) -> None:
        self.cap, self.ttl = cap, ttl
        self.lru: dict[str, OrderedDict[int, float]] = {}

    def expire(self, engine: str, now: float) -> None:
        lru = self.lru.get(engine)
        if lru is None:
            return
        for key in [k for k, t in lru.items() if t < now - self.ttl]:
            del lru[key]

    def routed(self, engine: str, keys: list[int], now: float) -> None:
        lru = self.lru.setdefault(engine, OrderedDict())
        for key in keys:
            lru.pop(key, None)
            lru[key] = now
        while len(lru) > self.cap:
            lru.popitem(last=False)
        self.expire(engine, now)


@settings(max_examples=300, deadline=None)
@given(
    cap=st.integers(1, 6),
    ops=st.lists(
        st.tuples(st.sampled_from(["routed", "routed", "forget"]), engine_st, keys_st, st.floats(0, 4)), max_size=40
    ),
    query=keys_st,
)
def test_routed_index_matches_the_brute_force_model(cap: int, ops: list, query: list[int]) -> None:
    index, model, now = RoutedIndex(max_blocks=cap, ttl_s=5.0), RoutedModel(cap, 5.0), 0.0
    for op, engine, keys, dt in ops:
        now += dt
        if op == "routed":
            index.routed(engine, keys, now)
            model.routed(engine, keys, now)
        else:
            index.forget(engine)
            model.lru.pop(engine, None)
        for e in ENGINES:
            assert index.blocks(e) == len(model.lru.get(e, ())) <= cap
    for e in ENGINES:
        model.expire(e, now)
    assert index.match(query, ASKED, now=now).tolist() == [leading(model.lru.get(e, {}), query) for e in ASKED]
    assert len(index) == len(set().union(*(set(lru) for lru in model.lru.values())))


def test_routed_index_expiry_and_lru_cap() -> None:
    index = RoutedIndex(max_blocks=3, ttl_s=10.0)
    index.routed("e", [1, 2], now=0.0)
    index.routed("e", [3], now=5.0)
    assert index.match([1, 2, 3], ("e",), now=9.0).tolist() == [3]
    assert index.match([1, 2, 3], ("e",), now=12.0).tolist() == [0]  # 1 and 2 expired at 10 s: 3 is not leading
    assert index.match([3], ("e",), now=12.0).tolist() == [1] and index.blocks("e") == 1
    index.routed("e", [3, 4, 5], now=13.0)
    index.routed("e", [3], now=14.0)  # refreshed: the least recently routed is now 4
    index.routed("e", [6], now=15.0)  # over the cap of 3: 4 goes
    assert index.blocks("e") == 3
    assert index.match([3], ("e",)).tolist() == [1] and index.match([4], ("e",)).tolist() == [0]
    assert index.match([5], ("e",)).tolist() == [1] and index.match([6], ("e",)).tolist() == [1]
    index.forget("e")
    assert len(index) == 0 and index.blocks("e") == 0


# -- block keys -------------------------------------------------------------------------------------------------

tokens_st = st.lists(st.integers(0, 2**17), max_size=80)
block_st = st.sampled_from([1, 2, 4, 16])


@settings(max_examples=200, deadline=None)
@given(common=tokens_st, a=tokens_st, b=tokens_st, block=block_st)
def test_equal_prefixes_have_equal_keys(common: list[int], a: list[int], b: list[int], block: int) -> None:
    ka, kb = block_keys(common + a, block), block_keys(common + b, block)
    shared = len(common) // block
    assert len(ka) == len(common + a) // block and ka.dtype == np.uint64
    assert np.array_equal(ka[:shared], kb[:shared])


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st.filter(lambda t: len(t) >= 1), data=st.data(), block=block_st)
def test_a_different_token_changes_every_later_key(tokens: list[int], data: st.DataObject, block: int) -> None:
    at = data.draw(st.integers(0, len(tokens) - 1))
    other = list(tokens)
    other[at] = tokens[at] + 1
    ka, kb = block_keys(tokens, block), block_keys(other, block)
    first = at // block
    assert np.array_equal(ka[:first], kb[:first])
    assert (ka[first:] != kb[first:]).all()


@settings(max_examples=200, deadline=None)
@given(a=tokens_st, b=tokens_st, block=block_st, salt=st.integers(0, 2**64 - 1))
def test_a_chain_continues_from_its_parent(a: list[int], b: list[int], block: int, salt: int) -> None:
    a = a[: len(a) // block * block]
    if not a:
        a = [7] * block
    whole = block_keys(a + b, block, salt=salt)
    parent = int(block_keys(a, block, salt=salt)[-1])
    assert np.array_equal(whole[len(a) // block :], block_keys(b, block, parent=parent))


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st.filter(lambda t: len(t) >= 4), salt=st.integers(1, 2**64 - 1))
def test_salt_separates_namespaces(tokens: list[int], salt: int) -> None:
    assert (block_keys(tokens, 4, salt=salt) != block_keys(tokens, 4)).all()
    assert np.array_equal(block_keys(tokens, 4, salt=salt), block_keys(np.asarray(tokens), 4, salt=salt))


def test_block_keys_edges() -> None:
    assert len(block_keys([1, 2, 3], 4)) == 0 and len(block_keys([], 16)) == 0
    assert len(block_keys(list(range(33)), 16)) == 2  # the partial last block has no key
    with pytest.raises(ValueError):
        block_keys([1], 0)
    assert np.array_equal(text_keys("héllo wörld", 4), text_keys("héllo wörld", 4))
    assert len(text_keys("abcdefgh", 4)) == 2


def test_full_hit_paths_of_the_walk() -> None:
    """The last key held: every key looked up at once; one holder set, or several (the running AND)."""
    keys = list(range(1, 11))
    same = {k: 0b101 for k in keys}
    assert leading_matches(same, keys, [0, 1, 2]).tolist() == [10, 0, 10]
    mixed = {k: 0b001 | (0b010 if k <= 4 else 0) | (0b100 if k != 6 else 0) for k in keys}
    assert leading_matches(mixed, keys, [0, 1, 2, -1]).tolist() == [10, 4, 5, 0]
    assert leading_matches(mixed, np.asarray(keys, dtype=np.uint64), [2, 1]).tolist() == [5, 4]
