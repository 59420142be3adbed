"""The router's batched histogram observations and counts fold into exactly what observing one by one gives."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from switchyard.services.router.metrics import Batched, BatchedCount

BUCKETS = (2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4)


def _samples(registry: CollectorRegistry) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }


def test_batched_observations_equal_one_by_one() -> None:
    values = [0.0, 1e-6, 2e-6, 2.0000001e-6, 5e-6, 7e-6, 1e-5, 3e-5, 1e-4, 2e-4, 5.0, 1e-5, 1e-6]
    results = []
    for batched in (False, True):
        registry = CollectorRegistry()
        histogram = Histogram("t", "t", ["kind"], buckets=BUCKETS, registry=registry)
        child = histogram.labels("decode")
        if batched:
            sink = Batched(child)
            for v in values[:5]:
                sink.observe(v)
            sink.flush()
            for v in values[5:]:
                sink.observe(v)
            sink.flush()
            sink.flush()  # nothing pending: no change
        else:
            for v in values:
                child.observe(v)
        results.append(_samples(registry))
    one_by_one, folded = results
    total = ("t_sum", (("kind", "decode"),))
    assert abs(one_by_one.pop(total) - folded.pop(total)) < 1e-12  # the sum, up to the order of additions
    assert one_by_one == folded  # every bucket and the count, exactly


def test_batched_falls_back_to_observe_without_prometheus_internals() -> None:
    class Plain:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, value: float) -> None:
            self.seen.append(value)

    plain = Plain()
    sink = Batched(plain)
    sink.observe(1.0)
    sink.observe(2.0)
    assert plain.seen == []
    sink.flush()
    assert plain.seen == [1.0, 2.0]


def test_batched_counts_reach_the_counter_when_flushed() -> None:
    registry = CollectorRegistry()
    child = Counter("c", "c", ["kind"], registry=registry).labels("dp")
    counted = BatchedCount(child)
    for _ in range(3):
        counted.inc()
    assert registry.get_sample_value("c_total", {"kind": "dp"}) == 0.0  # not yet
    counted.flush()
    counted.flush()  # nothing pending: no change
    counted.inc()
    counted.flush()
    assert registry.get_sample_value("c_total", {"kind": "dp"}) == 4.0
