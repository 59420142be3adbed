"""Named profiles: the routing rules as compositions of filters, scorers and a picker.

Decode (`sy.route.decode`, over decode engines):

| profile  | filters                | scorers (weight) | picker                               |
|----------|------------------------|------------------|--------------------------------------|
| `eldr`   | alive, τ band          | load (1)         | least cost, ties to the most similar |
| `domain` | alive, label partition | load (1)         | least cost, ties at random           |
| `jsq`    | alive                  | load (1)         | least cost, ties at random           |
| `p2c`    | alive                  | load (1)         | power of two choices                 |
| `rr`     | alive                  | —                | round robin                          |
| `random` | alive                  | —                | random                               |

Data-parallel dispatch (`sy.route.dp`, over DP engines; formulas in `solver.routing.dispatch`):

| profile     | filters         | scorers (weight)                                          | picker              |
|-------------|-----------------|-----------------------------------------------------------|---------------------|
| `gimbal`    | alive, KV first | remaining_prefill, waiting_prefill, inflight_tokens,      | first min           |
|             |                 | kv_penalty, moe_penalty (1 each)                          |                     |
| `llm-d`     | alive           | llmd_queue (2), llmd_kv_utilization (2), llmd_prefix (3)  | least cost (random) |
| `dynamo`    | alive           | dynamo_prefill (1), dynamo_decode (1)                     | softmax, T = 0      |
| `sglang-cache` | alive        | sglang_cache_aware (1): SGLang's three-branch rule        | first min           |
| `switchyard`| alive, KV first | gimbal's five, uncached_prompt (`PREFIX_WEIGHT`)          | first min           |
| `gimbal-exact` | alive, KV first | pending_prefill (1), pending (`PENDING_WEIGHT`),       | first min           |
|             |                 | decoding (`DECODE_WEIGHT`), recent_sends (`RECENT_WEIGHT`), |                   |
|             |                 | kv_penalty, moe_penalty (1)                               |                     |
| `switchyard-exact` | alive, KV first | gimbal-exact's terms less recent_sends,          | first min           |
|             |                 | uncached_prompt (`PREFIX_WEIGHT`)                         |                     |
| `gimbal-affinity` | alive, KV first | gimbal's five, expert_affinity (`AFFINITY_WEIGHT`)  | first min           |
| `vllm`      | alive           | waiting (4), running (1)                                  | first min           |
| `vllm-main` | alive           | vllm_main_load (1), vllm_main_kv (1)                      | first min, rotating |
| `jsq`       | alive           | outstanding (1)                                           | first min           |
| `rr`        | alive           | —                                                         | round robin         |

`gimbal-exact` is Algorithm 1 on the dispatcher's exact ledger (`solver.routing.exact_ledger`: what it sent
that has not reached its first token, and what is past it and not finished), where `gimbal` reads telemetry
and its timing-settled in-flight compensation; docs/gimbal-exact-ledger.md measures both against `vllm`.

The peers' profiles (`llm-d`, `dynamo`, `sglang-cache`) are built from each peer's published defaults; the
sources and what each column stands for are in their scorers' modules (`scorers.llmd`, `scorers.dynamo`,
`scorers.sglang`).

Weights are changed by scorer name (`decode_profile("jsq", {"load": 2})`, or the router's settings
`SWITCHYARD_ROUTER_DECODE_WEIGHTS` / `SWITCHYARD_ROUTER_DP_WEIGHTS`). The ELDR experiment variants
(`eldr-vanilla`, `eldr-tau0`) are not profiles: they are options of an ELDR simulation (the K-means an
artifact comes from, a τ override; `solver.routing.experiments`), and asking for one here is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from switchyard.solver.routing.dispatch import DISPATCH_POLICIES, GimbalParams
from switchyard.solver.routing.dp_kernels import ColumnsKernel, GimbalKernel
from switchyard.solver.routing.eldr_kernel import eldr_kernel
from switchyard.solver.routing.filters import Alive, DomainPartition, KvFirst, TauBand
from switchyard.solver.routing.framework import Profile, Weighted
from switchyard.solver.routing.pickers import FirstMin, LeastCost, PowerOfTwo, RandomPick, RoundRobin, SoftmaxSample
from switchyard.solver.routing.scorers import (
    Column,
    DynamoDecode,
    DynamoPrefill,
    ExpertAffinity,
    KvPenalty,
    LlmdKvUtilization,
    LlmdPrefix,
    LlmdQueue,
    MoePenalty,
    SglangCacheAware,
    UncachedPrompt,
    VllmMainKv,
    VllmMainLoad,
)
from switchyard.solver.routing.scorers.dynamo import DYNAMO_OVERLAP_WEIGHT, DYNAMO_TEMPERATURE
from switchyard.solver.routing.scorers.llmd import LLMD_WEIGHTS

__all__ = [
    "DECODE_PROFILES",
    "DP_PROFILES",
    "EXPERIMENT_VARIANTS",
    "decode_profile",
    "dp_profile",
]

_ALIVE = Alive()
_LOAD = (Weighted(Column("load"), 1.0),)

DECODE_PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("random", (_ALIVE,), (), RandomPick(), doc="uniform over live engines"),
        Profile("rr", (_ALIVE,), (), RoundRobin(), doc="round robin over live engines"),
        Profile("jsq", (_ALIVE,), _LOAD, LeastCost(), doc="join the shortest queue (least load)"),
        Profile("p2c", (_ALIVE,), _LOAD, PowerOfTwo(), doc="power of two choices"),
        Profile("domain", (_ALIVE, DomainPartition()), _LOAD, LeastCost(), doc="oracle: least loaded in its partition"),
        Profile(
            "eldr",
            (_ALIVE, TauBand()),
            _LOAD,
            LeastCost(),
            kernel=eldr_kernel,
            doc="τ-band over the artifact's centroids, least loaded, ties to the most similar",
        ),
    )
}

#: Experiment-only names: what each is, for the error that refuses it outside the simulator.
EXPERIMENT_VARIANTS: dict[str, str] = {
    "eldr-vanilla": "ELDR over a vanilla (unbalanced) K-means fit, a simulator option (fit='vanilla')",
    "eldr-tau0": "ELDR with τ = 0 (nearest centroid only), a simulator option (tau=0)",
}

#: DP profile names, in the simulator's `--dispatch` order.
DP_PROFILES: tuple[str, ...] = DISPATCH_POLICIES


def decode_profile(name: str, weights: Mapping[str, float] | None = None) -> Profile:
    """The named decode profile, re-weighted by scorer name; experiment variants and unknown names are errors."""
    if name in EXPERIMENT_VARIANTS:
        raise ValueError(
            f"{name!r} is not a router profile: it is {EXPERIMENT_VARIANTS[name]}; "
            f"route with 'eldr' and an artifact fitted as you want (profiles: {', '.join(DECODE_PROFILES)})"
        )
    try:
        profile = DECODE_PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown decode profile {name!r}; choose one of {', '.join(DECODE_PROFILES)}") from None
    return profile.weighted(weights) if weights else profile


#: The `switchyard` profile's default weight of ``uncached_prompt`` (docs/prefix-routing.md: the sweep).
PREFIX_WEIGHT = 8.0


def _gimbal_terms(params: GimbalParams) -> tuple[Weighted, ...]:
    """Gimbal's pressure score as weighted terms, in the kernel's order (`dp_kernels.GimbalKernel`)."""
    return (
        Weighted(Column("remaining_prefill"), 1.0),
        Weighted(Column("waiting_prefill"), 1.0),
        Weighted(Column("inflight_tokens"), 1.0),
        Weighted(KvPenalty(params), 1.0),
        Weighted(MoePenalty(params), 1.0),
    )


#: Prefill-token equivalent of one decoding request in `gimbal-exact` (`_exact_terms`; docs/gimbal-exact-ledger.md).
DECODE_WEIGHT = 256.0
#: Prefill-token equivalent of one request still owed its first token in `gimbal-exact`.
PENDING_WEIGHT = 2000.0
#: Prefill-token equivalent of one request just sent in `gimbal-exact` (``recent_sends``: each send decays as
#: exp(-age / RECENT_TAU_S), `exact_ledger.RECENT_TAU_S` = 20 ms). Why: at light load a prompt reaches its
#: first token within a step or two, so the next arrival sees no owed prefill anywhere and the decision falls to
#: decode load, which moves at every finish; consecutive arrivals then went to one engine in runs of 1.43 where
#: vLLM's per-window local increment alternates them (1.07), and lost 0.5 % mean TTFT at conv ÷20. A send
#: that weighs about 1.5 pending requests, fading over ~20 ms, alternates them (runs of 1.14). Fitted on seed 0
#: at conv ÷20 (500 to 4000 tried), then checked: lower mean TTFT than `vllm` at all 10 loads over seeds 0-2
#: (docs/gimbal-exact-ledger.md, "Recent sends").
RECENT_WEIGHT = 3000.0


def _exact_terms(params: GimbalParams, recent: bool = True) -> tuple[Weighted, ...]:
    """Gimbal's pressure score on the exact ledger (`solver.routing.exact_ledger`): the prefill the engine still
    owes (sent, no first token) replaces remaining + waiting + in-flight prefill, its decode load (requests past
    their first token, not finished) is a term of its own, and so (`recent`) are the requests just sent to it;
    P_kv and P_moe from telemetry as in `gimbal`."""
    return (
        Weighted(Column("pending_prefill"), 1.0),
        Weighted(Column("pending"), PENDING_WEIGHT),
        Weighted(Column("decoding"), DECODE_WEIGHT),
        *((Weighted(Column("recent_sends"), RECENT_WEIGHT),) if recent else ()),
        Weighted(KvPenalty(params), 1.0),
        Weighted(MoePenalty(params), 1.0),
    )


def _dp_gimbal(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "gimbal",
        (_ALIVE, KvFirst(params)),
        _gimbal_terms(params),
        FirstMin(),
        kernel=GimbalKernel(params),
        doc="Gimbal's pressure score (prefill-token units), KV-first when caches are nearly full and uneven",
    )


def _dp_switchyard(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "switchyard",
        (_ALIVE, KvFirst(params)),
        (*_gimbal_terms(params), Weighted(UncachedPrompt(), PREFIX_WEIGHT)),
        FirstMin(),
        kernel=GimbalKernel(params, PREFIX_WEIGHT),
        doc="Gimbal's pressure score plus the request's uncached prompt on each engine (prefix locality)",
    )


def _dp_gimbal_exact(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "gimbal-exact",
        (_ALIVE, KvFirst(params)),
        _exact_terms(params),
        FirstMin(),
        doc="Algorithm 1 on the dispatcher's exact ledger: prefill still owed + decode load + requests just "
        "sent + P_kv + P_moe",
    )


def _dp_switchyard_exact(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "switchyard-exact",
        (_ALIVE, KvFirst(params)),
        (*_exact_terms(params, recent=False), Weighted(UncachedPrompt(), PREFIX_WEIGHT)),
        FirstMin(),
        doc="gimbal-exact (without its recent_sends term, as measured) plus the request's uncached prompt on "
        "each engine (prefix locality)",
    )


#: The `gimbal-affinity` profile's default weight of ``expert_affinity``: where dispatch nearly segregates the ESFT
#: trace's tasks (88 % of requests on their task's engine); a measured setting, not a measured win
#: (docs/expert-affinity.md: the sweep, and what it costs).
AFFINITY_WEIGHT = 64.0


def _dp_gimbal_affinity(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "gimbal-affinity",
        (_ALIVE, KvFirst(params)),
        (*_gimbal_terms(params), Weighted(ExpertAffinity(), AFFINITY_WEIGHT)),
        FirstMin(),
        doc="Gimbal's pressure score plus the request's prompt discounted where recent traffic used the same "
        "experts (expert affinity, predicted from the prefix's recorded signature)",
    )


def _dp_llm_d(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "llm-d",
        (_ALIVE,),
        (
            Weighted(LlmdQueue(), LLMD_WEIGHTS["llmd_queue"]),
            Weighted(LlmdKvUtilization(), LLMD_WEIGHTS["llmd_kv_utilization"]),
            Weighted(LlmdPrefix(), LLMD_WEIGHTS["llmd_prefix"]),
        ),
        LeastCost(),
        doc="llm-d's default EPP: queue (2), KV utilisation (2) and prefix-cache (3) scores, max-score picker",
    )


def _dp_dynamo(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "dynamo",
        (_ALIVE,),
        (Weighted(DynamoPrefill(), DYNAMO_OVERLAP_WEIGHT), Weighted(DynamoDecode(), 1.0)),
        SoftmaxSample(DYNAMO_TEMPERATURE),
        doc="Dynamo's KV router: overlap_score_weight x prefill blocks not cached + decode blocks, temperature 0",
    )


def _dp_sglang_cache(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "sglang-cache",
        (_ALIVE,),
        (Weighted(SglangCacheAware(), 1.0),),
        FirstMin(),
        doc="SGLang's cache-aware policy: shortest queue if imbalanced, else longest prefix over the cache "
        "threshold, else the smallest tree",
    )


def _dp_vllm(params: GimbalParams, client_count: int) -> Profile:
    scorers = (Weighted(Column("waiting"), 4.0), Weighted(Column("running"), 1.0))
    return Profile(
        "vllm",
        (_ALIVE,),
        scorers,
        FirstMin(),
        kernel=ColumnsKernel.of(scorers),
        doc="vLLM's DP load balancer: 4·waiting + running, first minimum",
    )


def _dp_vllm_main(params: GimbalParams, client_count: int) -> Profile:
    return Profile(
        "vllm-main",
        (_ALIVE,),
        (Weighted(VllmMainLoad(client_count), 1.0), Weighted(VllmMainKv(), 1.0)),
        FirstMin(rotate=True),
        doc="vLLM main's DP load balancer, scan start rotating",
    )


def _dp_jsq(params: GimbalParams, client_count: int) -> Profile:
    scorers = (Weighted(Column("outstanding"), 1.0),)
    return Profile(
        "jsq", (_ALIVE,), scorers, FirstMin(), kernel=ColumnsKernel.of(scorers), doc="fewest outstanding requests"
    )


def _dp_rr(params: GimbalParams, client_count: int) -> Profile:
    return Profile("rr", (_ALIVE,), (), RoundRobin(), doc="round robin over live engines")


#: Each DP profile's builder, by name (checked against `DISPATCH_POLICIES` at import: a name without a builder, or a
#: builder without a name, is a bug).
_DP_BUILDERS: dict[str, Callable[[GimbalParams, int], Profile]] = {
    "gimbal": _dp_gimbal,
    "switchyard": _dp_switchyard,
    "gimbal-exact": _dp_gimbal_exact,
    "switchyard-exact": _dp_switchyard_exact,
    "gimbal-affinity": _dp_gimbal_affinity,
    "llm-d": _dp_llm_d,
    "dynamo": _dp_dynamo,
    "sglang-cache": _dp_sglang_cache,
    "vllm": _dp_vllm,
    "vllm-main": _dp_vllm_main,
    "jsq": _dp_jsq,
    "rr": _dp_rr,
}
if set(_DP_BUILDERS) != set(DISPATCH_POLICIES):
    raise RuntimeError(f"DP profile builders {sorted(_DP_BUILDERS)} differ from DISPATCH_POLICIES {DISPATCH_POLICIES}")


def dp_profile(
    name: str,
    params: GimbalParams | None = None,
    weights: Mapping[str, float] | None = None,
    client_count: int = 1,
) -> Profile:
    """The named DP profile with Gimbal's parameters (`gimbal`) and vLLM's client count (`vllm-main`)."""
    try:
        build = _DP_BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown DP profile {name!r}; choose one of {', '.join(DP_PROFILES)}") from None
    profile = build(params or GimbalParams(), client_count)
    return profile.weighted(weights) if weights else profile
