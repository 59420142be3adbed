"""Two tenants of equal tokens and different expert footprints on a saturated DP fleet, behind a tenant-aware
admission queue: the gateway's flow control (`services/gateway/flow.py`) modelled with the very same pure policy
(`solver/fairness.py`: `FairQueue`, `Footprints`, the `tokens` and `expert-load` costs).

The fleet: `engines` DP engines (`core.dp_engine.MixedEngine`, the model's physics), each saturated at
`concurrency` requests outstanding, as the gateway's `SATURATION_CONCURRENCY`; while every engine is at its
limit, arrivals wait in the queue and leave, one per free slot, to the engine with the fewest outstanding.
Under `fcfs` every request is one tenant's (arrival order); under `tokens` and `expert-load` the queue orders
the tenants by least attained service. As in the gateway, `expert-load` charges a request the tenant's recent
mean footprint when it leaves the queue and corrects the tenant's service when the request's first token (the
end of its prefill: when an engine publishes its signature) comes; the footprint is its prefill signature's.

The routing is synthetic, stated as such: every token of tenant `narrow` selects its top-k experts uniformly
among `narrow_experts` fixed experts per MoE layer (a domain that keeps to a few experts), every token of
tenant `wide` among all of them. Both tenants draw arrivals (Poisson, the same rate) and lengths (the same
distribution) from streams of their own, so their tokens are equal in distribution. `shuffle_labels` is the
control: each request's tenant label (what the queue sees) is drawn at random, so each "tenant" mixes narrow
and wide requests and a footprint-aware policy has nothing to tell apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchyard.shared.streams import stream
from switchyard.simulator.core.dp_engine import DPCost, MixedEngine
from switchyard.simulator.core.experts import ReplayBank, expert_bitsets
from switchyard.simulator.core.loop import ARRIVAL, EventLoop
from switchyard.simulator.core.physics import cost_model
from switchyard.solver.fairness import FairQueue, Footprints, Waiter, footprint, request_cost, weighted_tokens

__all__ = ["POLICIES", "TENANTS", "FairnessConfig", "FairnessResult", "simulate_fairness", "two_tenant_bank"]

POLICIES = ("fcfs", "tokens", "expert-load")
TENANTS = ("narrow", "wide")
_STEP_END = 0


@dataclass(frozen=True)
class FairnessConfig:
    policy: str = "expert-load"
    shuffle_labels: bool = False
    model: str = "deepseek-v2-lite"
    gpu: str = "H100"
    engines: int = 2
    concurrency: int = 32  #: requests outstanding per engine at saturation
    requests: int = 600  #: per tenant
    rate: float = 10.0  #: requests/s per tenant (Poisson)
    prompt_mean: int = 512  #: lengths: lognormal (sigma 0.5) around these means, the same for both tenants
    output_mean: int = 128
    narrow_experts: int = 16  #: experts per MoE layer tenant `narrow`'s tokens select among
    output_weight: float = 2.0  #: the gateway's `OUTPUT_TOKEN_WEIGHT`
    bank_rows: int = 64  #: replayed routing sequences per tenant (64 prefill + 64 decode tokens each)
    seed: int = 0


@dataclass
class FairnessResult:
    config: FairnessConfig
    #: per true tenant: TTFT P50 / P90 (s, queue wait included), TPOT P50 / mean (s), requests, output tokens
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)
    throughput_tok_s: float = 0.0  #: output tokens / (last finish - first arrival)
    makespan_s: float = 0.0
    mean_distinct: float = 0.0  #: distinct experts per MoE layer in a step, mean over steps
    mean_step_s: float = 0.0

    def row(self) -> dict[str, object]:
        c = self.config
        out: dict[str, object] = {"policy": c.policy, "shuffled": c.shuffle_labels, "seed": c.seed}
        for name, figures in self.tenants.items():
            out.update({f"{name}_{k}": v for k, v in figures.items()})
        out.update(
            throughput_tok_s=self.throughput_tok_s,
            makespan_s=self.makespan_s,
            mean_distinct=self.mean_distinct,
            mean_step_s=self.mean_step_s,
        )
        return out


def _tokens(rng: np.random.Generator, n: int, layers: int, pool: np.ndarray, k: int) -> np.ndarray:
    """[n, L, k] expert ids: each token's top-k at layer l, distinct, uniform among `pool[l]`."""
    keys = rng.random((n, layers, pool.shape[1]))
    pick = np.argsort(keys, axis=-1)[..., :k]
    return np.take_along_axis(np.broadcast_to(pool[None], (n, *pool.shape)), pick, axis=-1)


def two_tenant_bank(config: FairnessConfig) -> tuple[ReplayBank, np.ndarray, np.ndarray]:
    """(bank, tenant of each row, footprint of each row's prefill signature); rows [0, R) narrow, [R, 2R) wide."""
    spec = cost_model(config.model, config.gpu).model
    layers, experts, k, rows = spec.moe_layers, spec.num_experts, spec.top_k, config.bank_rows
    if not k <= config.narrow_experts <= experts:
        raise ValueError(f"narrow_experts must lie in [{k}, {experts}], got {config.narrow_experts}")
    pool_rng, token_rng = stream(config.seed, "fairness.pools"), stream(config.seed, "fairness.routing")
    narrow_pool = np.stack([pool_rng.permutation(experts)[: config.narrow_experts] for _ in range(layers)])
    wide_pool = np.broadcast_to(np.arange(experts), (layers, experts))
    per_row = 64
    prefill_bits, decode_bits, shares = [], [], []
    for pool in (narrow_pool, wide_pool):
        for _ in range(rows):
            ids = _tokens(token_rng, 2 * per_row, layers, pool, k)
            bits = expert_bitsets(ids, experts)
            prefill_bits.append(np.bitwise_or.reduce(bits[:per_row], axis=0))
            decode_bits.append(bits[per_row:])
            counts = np.zeros((layers, experts), np.int64)
            np.add.at(counts, (np.arange(layers)[None, :, None], ids[:per_row]), 1)
            shares.append(footprint(counts))
    n = 2 * rows
    bank = ReplayBank(
        decode_bits=np.ascontiguousarray(np.concatenate(decode_bits)),
        decode_start=np.arange(n, dtype=np.int64) * per_row,
        decode_len=np.full(n, per_row, np.int64),
        prefill_bits=np.stack(prefill_bits),
        prefill_len=np.full(n, per_row, np.int64),
        labels=np.repeat(np.arange(2), rows),
        label_names=TENANTS,
        num_experts=experts,
        request_ids=np.arange(n, dtype=np.int64),
    )
    return bank, np.repeat(np.arange(2), rows), np.asarray(shares)


@dataclass
class _Requests:
    arrival: np.ndarray
    tenant: np.ndarray  # true tenant (0 narrow, 1 wide)
    label: np.ndarray  # what the queue sees
    row: np.ndarray
    prompt: np.ndarray
    output: np.ndarray


def _requests(config: FairnessConfig, rows: int) -> _Requests:
    """Both tenants' arrivals and lengths, each from its own streams (equal in distribution)."""
    parts = []
    for t, name in enumerate(TENANTS):
        arrive = stream(config.seed, f"fairness.arrivals.{name}")
        lengths = stream(config.seed, f"fairness.lengths.{name}")
        replay = stream(config.seed, f"fairness.replay.{name}")
        n = config.requests
        times = np.cumsum(arrive.exponential(1.0 / config.rate, n))
        prompt = np.maximum(1, np.round(lengths.lognormal(np.log(config.prompt_mean) - 0.125, 0.5, n)))
        output = np.maximum(2, np.round(lengths.lognormal(np.log(config.output_mean) - 0.125, 0.5, n)))
        parts.append((times, np.full(n, t), t * rows + replay.integers(0, rows, n), prompt, output))
    order = np.argsort(np.concatenate([p[0] for p in parts]), kind="stable")
    arrival, tenant, row, prompt, output = (np.concatenate([p[i] for p in parts])[order] for i in range(5))
    label = tenant.copy()
    if config.shuffle_labels:
        label = stream(config.seed, "fairness.shuffle").permutation(label)
    return _Requests(
        arrival, tenant.astype(np.int64), label.astype(np.int64), row, prompt.astype(np.int64), output.astype(np.int64)
    )


def simulate_fairness(config: FairnessConfig) -> FairnessResult:
    """Run the two-tenant scenario under `config.policy` (see the module docstring)."""
    if config.policy not in POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}; one of {', '.join(POLICIES)}")
    bank, _row_tenant, shares = two_tenant_bank(config)
    req = _requests(config, config.bank_rows)
    n = len(req.arrival)
    dp = DPCost(cost_model(config.model, config.gpu), ep_ranks=1)
    engines = [MixedEngine(dp, bank, max_running=config.concurrency) for _ in range(config.engines)]
    queue = FairQueue(max_queued=n + 1, max_per_tenant=n + 1, max_tenants=16, bands=1)
    prints = Footprints(max_tenants=16)
    charged: dict[int, tuple[float, float]] = {}  # request -> (weighted tokens, footprint estimate charged)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    steps, distinct_sum, step_time = 0, 0.0, 0.0
    loop = EventLoop()

    def outstanding(e: int) -> int:
        return engines[e].num_running + engines[e].num_waiting

    def start(e: int, now: float) -> None:
        nonlocal steps, distinct_sum, step_time
        engine = engines[e]
        if engine.busy:
            return
        plan = engine.begin_step(now)
        if plan is None:
            return
        steps += 1
        distinct_sum += float(np.bitwise_count(plan.union).sum()) / plan.union.shape[0]
        step_time += plan.duration
        loop.push(now + plan.duration, _STEP_END, e)

    def dispatch(now: float) -> None:
        while len(queue):
            e = min(range(len(engines)), key=outstanding)
            if outstanding(e) >= config.concurrency:
                return
            waiter = queue.pop()
            assert waiter is not None
            i = int(waiter.ticket)
            engines[e].add(i, int(req.row[i]), int(req.prompt[i]), int(req.output[i]), float(req.arrival[i]))
            start(e, now)

    for now, kind, index in loop.events(req.arrival):
        if kind == ARRIVAL:
            i = index
            tenant = "" if config.policy == "fcfs" else TENANTS[int(req.label[i])]
            weighted = weighted_tokens(int(req.prompt[i]), int(req.output[i]), config.output_weight)
            cost = weighted
            if config.policy == "expert-load":
                estimate = prints.estimate(tenant)
                charged[i] = (weighted, 1.0 if estimate is None else estimate)
                cost = request_cost("expert-load", weighted, estimate)
            queue.push(Waiter(0, tenant, cost, now, ticket=i))
            dispatch(now)
            continue
        out = engines[index].end_step()
        for i in out.first:
            first[i] = now
            if config.policy == "expert-load":  # the prefill ended: its signature corrects the charge
                tenant = TENANTS[int(req.label[i])]
                share = float(shares[req.row[i]])
                weighted, estimate = charged.pop(i)
                prints.observe(tenant, share)
                queue.charge(tenant, weighted * (share - estimate))
        for i in out.finished:
            finish[i] = now
        dispatch(now)
        start(index, now)
        if np.isfinite(finish).all():
            break
    return _result(config, req, first, finish, steps, distinct_sum, step_time)


def _result(
    config: FairnessConfig,
    req: _Requests,
    first: np.ndarray,
    finish: np.ndarray,
    steps: int,
    distinct_sum: float,
    step_time: float,
) -> FairnessResult:
    result = FairnessResult(config)
    ttft = first - req.arrival
    tpot = (finish - first) / np.maximum(req.output - 1, 1)
    for t, name in enumerate(TENANTS):
        mine = req.tenant == t
        result.tenants[name] = {
            "ttft_p50_s": float(np.percentile(ttft[mine], 50)),
            "ttft_p90_s": float(np.percentile(ttft[mine], 90)),
            "tpot_p50_s": float(np.percentile(tpot[mine], 50)),
            "tpot_mean_s": float(tpot[mine].mean()),
            "requests": float(mine.sum()),
            "output_tokens": float(req.output[mine].sum()),
        }
    result.makespan_s = float(np.nanmax(finish) - req.arrival.min())
    result.throughput_tok_s = float(req.output.sum()) / result.makespan_s
    result.mean_distinct = distinct_sum / max(steps, 1)
    result.mean_step_s = step_time / max(steps, 1)
    return result
