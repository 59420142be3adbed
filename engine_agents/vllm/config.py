"""What the vLLM agent reads from vLLM's configuration and scheduler: pure functions over duck-typed objects.

Nothing here imports vLLM, so it is tested with the core suite; `plugin.py` hands in the real objects. The
names of the Hugging Face config attributes differ between MoE families, so each function tries the known
spellings and says which it could not find.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from switchyard.engine_agents.core.expert_load import contiguous_ranks
from switchyard.engine_agents.core.expert_load import expert_pressure as core_expert_pressure
from switchyard.shared.schemas import Capacity, Hello, ModelShape
from switchyard.shared.subjects import check_token
from switchyard.solver.routing.dispatch import GimbalParams, queue_order

_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "experts_per_token", "num_experts_per_token")


class AgentSettings(BaseSettings):
    """`SWITCHYARD_AGENT_*`: how one vLLM engine presents itself on the bus (NATS itself: `SWITCHYARD_NATS_*`)."""

    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_AGENT_", extra="ignore")

    #: The plugin is installed with Switchyard but does nothing unless this is set.
    enabled: bool = False
    #: Default: `<hostname>-dp<data-parallel rank>`, the same in every process of the engine.
    engine_id: str | None = None
    #: The EP group whose experts this engine serves with others. Default: the engine id (its own group).
    ep_group: str | None = None
    #: GPU names as the placement service should know them. Default: `<engine id>-gpu<i>` per TP × PP rank.
    gpus: list[str] | None = None
    #: Overrides the role read from `kv_transfer_config` (kv_producer: prefill, kv_consumer: decode, else dp).
    role: Literal["prefill", "decode", "dp"] | None = None
    #: The engine's OpenAI base URL as the gateway reaches it (e.g. `http://10.0.0.5:8000`); vLLM's engine core
    #: does not know its API server's address, so it is said here. Unset: the gateway does not route to it.
    base_url: str | None = None

    #: Seconds between hellos (the engine's announcement; at most 60, what `Hello` allows): services count an
    #: engine gone after missing a few (`SWITCHYARD_LIVENESS_MISSES`).
    hello_interval_s: float = Field(default=5.0, gt=0, le=60)
    #: Seconds between telemetry messages (load, KV usage, queue): what the router's pressure scores read.
    telemetry_interval_s: float = Field(default=0.1, gt=0, le=60)
    #: Expert-load windows (`sy.engine.<id>.expert_load`) are flushed this often.
    expert_load_interval_s: float = Field(default=1.0, gt=0)
    #: Share of requests (chosen by a hash of the request id) published as routing samples on
    #: `SY_ROUTING_SAMPLES`, for `switchyard fit --from-stream`. Off by default: on a GPU each step with such a
    #: request copies its rows' expert ids to the host (a synchronisation). The variable's old name,
    #: `SWITCHYARD_AGENT_CALIBRATION_FRACTION`, is still read.
    routing_sample_fraction: float = Field(
        default=0.0,
        ge=0,
        le=1,
        validation_alias=AliasChoices(
            "routing_sample_fraction",
            "SWITCHYARD_AGENT_ROUTING_SAMPLE_FRACTION",
            "SWITCHYARD_AGENT_CALIBRATION_FRACTION",
        ),
    )
    #: Every request's prefill signature from per-KV-block counts, published as `PrefillSignature` on
    #: `sy.engine.<id>.signature` when its prefill ends (`engine_agents/vllm/signatures.py`).
    signatures: bool = True
    #: Relay vLLM's KV-cache events as `KvEvents` on `sy.engine.<id>.kv` (the router's precise prefix index).
    #: It takes effect only when vLLM publishes them: the operator starts `vllm serve` with
    #: `--enable-prefix-caching --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
    #: "endpoint": "tcp://*:5557"}'` (one free port per engine on a host; a data-parallel rank adds its rank to
    #: the port, as vLLM does). The agent reads that config and subscribes in the engine's process
    #: (`engine_agents/vllm/kv_relay.py`); nothing else is to be set.
    kv_events: bool = True
    #: Bound on the relay's vLLM hash -> key map. Default: twice the engine's KV blocks (+4096).
    kv_relay_max_hashes: int | None = Field(default=None, gt=0)
    #: θ_age of the SJF-with-aging scheduler class (`engine_agents/vllm/sjf.py`): requests waiting longer go first.
    sjf_age_threshold_s: float = Field(default=5.0, ge=0)


def _first(config: Any, names: Iterable[str], what: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"the model config has no {what} (looked for {', '.join(names)}): is it a MoE model?")


def moe_layers(hf_config: Any) -> list[int]:
    """Indices of the decoder layers that have routed experts.

    DeepSeek: every layer from `first_k_dense_replace` (every `moe_layer_freq`-th). Qwen-MoE: layers not in
    `mlp_only_layers` whose index + 1 is a multiple of `decoder_sparse_step`. Otherwise every layer.
    """
    total = _first(hf_config, ("num_hidden_layers", "n_layers", "num_layers"), "layer count")
    if getattr(hf_config, "first_k_dense_replace", None) is not None:
        first, every = int(hf_config.first_k_dense_replace), int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        return [i for i in range(first, total) if (i - first) % every == 0]
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [i for i in range(total) if i not in dense and (i + 1) % step == 0]


def model_shape(hf_config: Any, name: str) -> ModelShape:
    layers = moe_layers(hf_config)
    if not layers:
        raise ValueError("the model config describes no MoE layer")
    experts, top_k = _first(hf_config, _EXPERTS, "routed expert count"), _first(hf_config, _TOP_K, "top-k")
    return ModelShape(name=name[-128:], num_layers=len(layers), num_experts=experts, top_k=top_k)


def role_of(kv_transfer_config: Any) -> Literal["prefill", "decode", "dp"]:
    """prefill for a KV producer, decode for a KV consumer, dp for everything else (kv_both, no transfer)."""
    kv_role = getattr(kv_transfer_config, "kv_role", None)
    return "prefill" if kv_role == "kv_producer" else "decode" if kv_role == "kv_consumer" else "dp"


def engine_identity(settings: AgentSettings, dp_rank: int) -> tuple[str, str]:
    """The engine id and EP group, valid as subject tokens (hostnames with dots are rewritten)."""
    host = socket.gethostname().split(".")[0].replace("_", "-") or "vllm"
    engine_id = settings.engine_id or f"{host}-dp{dp_rank}"
    return check_token(engine_id, "engine id"), check_token(settings.ep_group or engine_id, "ep group")


def build_hello(vllm_config: Any, num_gpu_blocks: int, settings: AgentSettings, version: str) -> Hello:
    """The engine's hello from its `VllmConfig` and the KV blocks the engine allocated."""
    parallel = vllm_config.parallel_config
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    engine_id, group = engine_identity(settings, dp_rank)
    ranks = int(getattr(parallel, "tensor_parallel_size", 1)) * int(getattr(parallel, "pipeline_parallel_size", 1))
    model = vllm_config.model_config
    return Hello(
        engine_id=engine_id,
        role=settings.role or role_of(vllm_config.kv_transfer_config),
        model=model_shape(model.hf_config, str(model.served_model_name or model.model)),
        ep_group=group,
        dp_rank=dp_rank,
        gpus=settings.gpus or [f"{engine_id}-gpu{i}" for i in range(ranks)],
        capacity=Capacity(
            max_running=vllm_config.scheduler_config.max_num_seqs,
            kv_blocks=max(int(num_gpu_blocks), 1),
            block_size=vllm_config.cache_config.block_size,
            max_model_len=getattr(model, "max_model_len", None) or None,
        ),
        ts=0.0,
        agent="vllm",
        agent_version=version[:64],
        migrates=False,  # see runtime.EngineCoreAgent: no external EPLB trigger yet
        hello_interval_s=settings.hello_interval_s,
        telemetry_interval_s=settings.telemetry_interval_s,
        base_url=settings.base_url,
    )


def kv_events_endpoint(kv_events_config: Any, resolved: str | None) -> tuple[str, str] | str:
    """`(endpoint, topic)` where the relay subscribes to vLLM's KV events, or why it cannot (a sentence).

    `resolved`: the endpoint vLLM's publisher reports once bound (port offset by the DP rank, `*:0` resolved).
    """
    from switchyard.engine_agents.vllm.kv_relay import local_endpoint

    if kv_events_config is None or not getattr(kv_events_config, "enable_kv_cache_events", False):
        return "vLLM publishes no KV events (no --kv-events-config with enable_kv_cache_events)"
    if getattr(kv_events_config, "publisher", None) != "zmq":
        return f"vLLM's KV-event publisher is {kv_events_config.publisher!r}; the relay reads 'zmq'"
    endpoint = local_endpoint(str(kv_events_config.endpoint), resolved)
    if endpoint is None:
        return f"vLLM connects its KV-event socket out to {kv_events_config.endpoint}; the relay needs it to bind"
    return endpoint, str(getattr(kv_events_config, "topic", "") or "")


def queue_tokens(requests: Iterable[Any]) -> int:
    """Prompt tokens not yet prefilled, over vLLM `Request`s (`num_prompt_tokens - num_computed_tokens`)."""
    return sum(max(int(r.num_prompt_tokens) - int(r.num_computed_tokens), 0) for r in requests)


def sjf_order(queue: Any, params: GimbalParams, now: float) -> bool:
    """Reorder vLLM's FCFS waiting queue (a deque of `Request`s) in place by Gimbal's Algorithm 2.

    Aged requests (waited > θ_age, from `arrival_time`) first, longest wait first; then fewest prompt tokens
    still to prefill first; ties keep queue order. Returns whether the order changed.
    """
    if len(queue) < 2:
        return False
    requests = list(queue)
    remaining = np.array([max(int(r.num_prompt_tokens) - int(r.num_computed_tokens), 0) for r in requests], np.int64)
    waited = np.array([now - float(r.arrival_time) for r in requests], np.float64)
    order = queue_order(remaining, waited, params)
    if np.array_equal(order, np.arange(len(requests))):
        return False
    queue.clear()
    queue.extend(requests[i] for i in order)
    return True


def expert_parallelism(parallel_config: Any) -> tuple[int, int, int]:
    """`(ep_size, dp_rank, dp_size)`: vLLM's EP group spans TP × DP ranks when expert parallelism is on, else 1."""
    dp_size = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    dp_rank = int(getattr(parallel_config, "data_parallel_rank", 0) or 0)
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    ep = tp * dp_size if getattr(parallel_config, "enable_expert_parallel", False) else 1
    return ep, dp_rank, dp_size


def expert_pressure(counts: np.ndarray, ep_size: int) -> float:
    """Gimbal's MoE pressure from one window's `[L, E]` counts: the busiest EP rank's load over the mean rank's,
    averaged over layers with load (1 = balanced or no EP). vLLM places experts contiguously over EP ranks."""
    if ep_size <= 1:
        return 1.0
    return core_expert_pressure(counts, contiguous_ranks(counts.shape[1], ep_size), ep_size)


def source_counts(counts: np.ndarray, dp_rank: int, dp_size: int, tp_size: int) -> np.ndarray | None:
    """`A[L, S, E]` for an engine of a vLLM DP+EP deployment: its tokens all start on its own DP rank.

    Sources are the EP ranks (`dp_size × tp_size`, vLLM's order: `dp_rank * tp_size + tp_rank`); a DP rank's
    tokens are attributed to its first EP rank (exact for TP = 1; with TP > 1 each TP rank holds the same
    tokens). None for a single DP rank, where the source is always the engine itself.
    """
    if dp_size <= 1:
        return None
    layers, experts = counts.shape
    sources = np.zeros((layers, dp_size * tp_size, experts), dtype=counts.dtype)
    sources[:, dp_rank * tp_size, :] = counts
    return sources
