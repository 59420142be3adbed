"""Hypothesis strategies producing valid instances of every bus message."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from switchyard.shared import schemas as s
from switchyard.shared.placement_terms import TERM_NAME_PATTERN

ids = st.from_regex(r"\A[A-Za-z0-9_-]{1,64}\Z")
request_ids = st.text(min_size=1, max_size=128)
counts = st.integers(min_value=0, max_value=2**40)
small_counts = st.integers(min_value=0, max_value=10_000)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)
#: Plan ids: printable (no NUL or control characters, which storage refuses).
plan_ids = st.text(
    st.characters(min_codepoint=0x20, exclude_characters="\x7f", exclude_categories=("Cs",)), min_size=1, max_size=64
)
fractions = st.floats(min_value=0, max_value=1, allow_nan=False)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
nonneg = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)
uint_dtypes = st.sampled_from([np.uint8, np.uint16, np.uint32, np.int32, np.int64])


def int_arrays(ndim: int, max_side: int = 6, signed: bool = False, min_side: int = 0) -> st.SearchStrategy[np.ndarray]:
    dtypes = st.sampled_from([np.int8, np.int16, np.int32, np.int64]) if signed else uint_dtypes
    return dtypes.flatmap(
        lambda dt: hnp.arrays(
            dt,
            hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=min_side, max_side=max_side),
            elements=st.integers(0 if not signed else -1, 100),
        )
    )


@st.composite
def model_shapes(draw: st.DrawFn) -> s.ModelShape:
    experts = draw(st.integers(1, 256))
    return s.ModelShape(
        name=draw(st.text(min_size=1, max_size=20)),
        num_layers=draw(st.integers(1, 64)),
        num_experts=experts,
        top_k=draw(st.integers(1, experts)),
    )


hellos = st.builds(
    s.Hello,
    engine_id=ids,
    role=st.sampled_from(["prefill", "decode", "dp"]),
    model=model_shapes(),
    ep_group=ids,
    dp_rank=small_counts,
    gpus=st.lists(st.text(max_size=10), max_size=8),
    capacity=st.builds(
        s.Capacity, max_running=st.integers(1, 4096), kv_blocks=st.integers(1, 10**6), block_size=st.integers(1, 256)
    ),
    ts=times,
    agent=st.sampled_from(["sim", "vllm"]) | st.from_regex(r"[a-z][a-z0-9_-]{0,15}", fullmatch=True),
    agent_version=st.text(max_size=10),
)
telemetries = st.builds(
    s.Telemetry,
    engine_id=ids,
    seq=counts,
    ts=times,
    kv_usage=fractions,
    num_running=small_counts,
    num_waiting=small_counts,
    waiting_prefill_tokens=counts,
    remaining_prefill_tokens=counts,
    step_time_ema=nonneg,
    expert_pressure=nonneg,
    migrating=st.booleans(),
)


@st.composite
def expert_loads(draw: st.DrawFn) -> s.ExpertLoad:
    b = draw(int_arrays(2, min_side=1))  # a window has at least one layer and one expert
    start = draw(times)
    a = None
    if draw(st.booleans()):
        sources = draw(st.integers(0, 4))
        a = np.zeros((b.shape[0], sources, b.shape[1]), dtype=np.uint32)
    return s.ExpertLoad(
        engine_id=draw(ids),
        ep_group=draw(ids),
        seq=draw(counts),
        window_start=start,
        window_end=start + draw(st.floats(0, 1000)),
        expert_counts=b,
        source_counts=a,
    )


@st.composite
def route_decode_requests(draw: st.DrawFn) -> s.RouteDecodeRequest:
    sig = draw(st.none() | int_arrays(2))
    layers = None
    if sig is not None and draw(st.booleans()):
        layers = draw(st.lists(small_counts, min_size=sig.shape[0], max_size=sig.shape[0]))
    return s.RouteDecodeRequest(
        request_id=draw(request_ids),
        prompt_tokens=draw(counts),
        signature=sig,
        layers=layers,
        label=draw(st.none() | st.text(max_size=20)),
        prefill_engine_id=draw(st.none() | ids),
    )


route_decode_replies = st.builds(
    s.RouteDecodeReply,
    request_id=request_ids,
    engine_id=ids,
    policy=st.text(max_size=10),
    band_size=small_counts,
    decision_us=nonneg,
    artifact_version=st.none() | small_counts,
    fallback=st.none() | st.text(max_size=10),
)
block_keys = st.lists(st.integers(0, 2**64 - 1), max_size=40).map(lambda k: np.array(k, dtype=np.uint64))
route_dp_requests = st.builds(
    s.RouteDpRequest,
    request_id=request_ids,
    prompt_tokens=counts,
    block_keys=st.none() | block_keys,
    key_kind=st.sampled_from(["tokens", "text"]),
)
kv_ops = st.one_of(
    st.builds(s.KvOp, kind=st.sampled_from(["stored", "removed"]), keys=block_keys),
    st.builds(s.KvOp, kind=st.just("cleared"), keys=st.just(np.zeros(0, dtype=np.uint64))),
)
kv_events = st.builds(
    s.KvEvents, engine_id=ids, seq=counts, ts=times, block_size=st.integers(1, 4096), ops=st.lists(kv_ops, max_size=6)
)
route_dp_replies = st.builds(
    s.RouteDpReply, request_id=request_ids, engine_id=ids, priority=st.integers(-(2**40), 2**40), decision_us=nonneg
)
term_names = st.from_regex(TERM_NAME_PATTERN, fullmatch=True).filter(lambda name: name != "total")
objectives = st.builds(s.ObjectiveTerms, terms=st.dictionaries(term_names, nonneg, max_size=5), total=finite)
params = st.builds(s.PlacementParams, weights=st.dictionaries(term_names, finite, max_size=5))


@st.composite
def moves(draw: st.DrawFn) -> np.ndarray:
    n = draw(st.integers(0, 8))
    return draw(hnp.arrays(np.int32, (n, 6), elements=st.integers(0, 300)))


@st.composite
def placement_plans(draw: st.DrawFn) -> s.PlacementPlan:
    gpus = draw(st.lists(st.text(max_size=8), min_size=1, max_size=4))
    placement = draw(
        hnp.arrays(
            np.int16, (draw(st.integers(1, 4)), len(gpus), draw(st.integers(1, 4))), elements=st.integers(-1, 127)
        )
    )
    return s.PlacementPlan(
        plan_id=draw(plan_ids),
        version=draw(st.integers(1, 10**6)),
        engine_group=draw(ids),
        base_version=draw(st.none() | small_counts),
        created_at=draw(times),
        source=draw(st.sampled_from(["greedy", "minlp", "manual", "rollback"])),
        gpus=gpus,
        placement=placement,
        moves=draw(moves()),
        objective=draw(objectives),
        params=draw(params),
        predicted_gain=draw(finite),
    )


migrate_requests = st.builds(
    s.MigrateRequest,
    plan_id=plan_ids,
    version=st.integers(1, 10**6),
    engine_group=ids,
    step=small_counts,
    moves=moves(),
)
migrate_replies = st.builds(
    s.MigrateReply,
    plan_id=plan_ids,
    version=st.integers(1, 10**6),
    step=small_counts,
    applied=small_counts,
    duration_s=nonneg,
    failure=st.none() | st.text(max_size=30),
)

layout_requests = st.builds(s.LayoutRequest, engine_group=ids)


@st.composite
def layout_replies(draw: st.DrawFn) -> s.LayoutReply:
    shape = draw(st.tuples(st.integers(0, 4), st.integers(1, 4), st.integers(0, 5)))
    return s.LayoutReply(
        engine_group=draw(ids),
        layout=draw(hnp.arrays(np.int32, shape, elements=st.integers(-1, 300))),
        version=draw(small_counts),
        plan_id=draw(st.none() | st.text(max_size=64)),
    )


@st.composite
def routing_samples(draw: st.DrawFn) -> s.RoutingSample:
    pre = draw(int_arrays(2))
    post = draw(hnp.arrays(np.uint16, pre.shape, elements=st.integers(0, 1000)))
    return s.RoutingSample(
        engine_id=draw(ids),
        request_id=draw(request_ids),
        ts=draw(times),
        prompt_tokens=draw(counts),
        decode_tokens=draw(counts),
        prefill_counts=pre,
        decode_counts=post,
        label=draw(st.none() | st.text(max_size=20)),
    )


@st.composite
def routing_artifacts(draw: st.DrawFn) -> s.RoutingArtifact:
    shape = draw(model_shapes())
    mask = sorted(draw(st.sets(st.integers(0, shape.num_layers - 1), min_size=1, max_size=shape.num_layers)))
    k = draw(st.integers(1, 6))
    floats = st.floats(-10, 10, allow_nan=False, width=32)
    idf = draw(hnp.arrays(np.float32, (len(mask), shape.num_experts), elements=floats))
    centroids = draw(hnp.arrays(np.float32, (k, len(mask) * shape.num_experts), elements=floats))
    decoders = draw(st.none() | st.lists(ids, min_size=k, max_size=k))
    return s.RoutingArtifact(
        version=draw(st.integers(1, 10**6)),
        content_hash=draw(st.from_regex(r"\A[0-9a-f]{16,64}\Z")),
        created_at=draw(times),
        model=shape,
        representation="count_idf",
        layer_mask=mask,
        idf=idf,
        centroids=centroids,
        tau=draw(st.floats(0, 2)),
        rho=draw(st.floats(-1, 1)),
        decoder_ids=decoders,
        num_calibration=draw(small_counts),
        signature=draw(st.none() | st.from_regex(r"\A[0-9a-f]{64}\Z")),
    )


@st.composite
def route_decisions(draw: st.DrawFn) -> s.RouteDecisions:
    n = draw(st.integers(0, 8))
    return s.RouteDecisions(
        replica_id=draw(st.text(min_size=1, max_size=64)),
        kinds=draw(st.lists(st.sampled_from(["decode", "dp"]), min_size=n, max_size=n)),
        request_ids=draw(st.lists(request_ids, min_size=n, max_size=n)),
        engine_ids=draw(st.lists(ids, min_size=n, max_size=n)),
        prompt_tokens=draw(st.lists(counts, min_size=n, max_size=n)),
    )


announces = st.builds(s.Announce, requester=st.text(min_size=1, max_size=64), engine_id=st.none() | ids)


@st.composite
def prefill_signatures(draw: st.DrawFn) -> s.PrefillSignature:
    prompt = draw(st.integers(0, 100_000))
    return s.PrefillSignature(
        engine_id=draw(ids),
        request_id=draw(request_ids),
        ts=draw(times),
        prompt_tokens=prompt,
        cached_tokens=draw(st.integers(0, prompt)),
        signature=draw(int_arrays(2)),
    )


ALL_MESSAGES = {
    s.RouteDecisions: route_decisions(),
    s.Announce: announces,
    s.Hello: hellos,
    s.Telemetry: telemetries,
    s.ExpertLoad: expert_loads(),
    s.RouteDecodeRequest: route_decode_requests(),
    s.RouteDecodeReply: route_decode_replies,
    s.RouteDpRequest: route_dp_requests,
    s.RouteDpReply: route_dp_replies,
    s.KvEvents: kv_events,
    s.PlacementPlan: placement_plans(),
    s.MigrateRequest: migrate_requests,
    s.MigrateReply: migrate_replies,
    s.LayoutRequest: layout_requests,
    s.LayoutReply: layout_replies(),
    s.RoutingSample: routing_samples(),
    s.PrefillSignature: prefill_signatures(),
    s.RoutingArtifact: routing_artifacts(),
}
