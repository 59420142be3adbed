"""infra/ deployment material against the code: the image, the Compose file and the Helm chart.

Nothing here can pull or run images, so what can drift is checked instead: every file parses; every `switchyard`
command and option they run exists in the CLI; every environment variable they set for a Switchyard process is a
real setting (the pydantic-settings classes' names and aliases) and its value validates; every port and probe path
is one the code serves; the NATS cluster configs pass `nats-server -t`; the chart passes Helm's own lint and renders
(Helm itself, through the `helm-python-sdk` package: Helm's Go SDK, no binary) to Kubernetes objects that validate
against Kubernetes' schemas (`kubernetes-validate`) and whose probes, ports, Secrets and selectors fit together.
Each check is a function that returns the problems it finds, and is also run on a broken copy.
"""

from __future__ import annotations

import copy
import importlib
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import helm_python as helm
import kubernetes_validate
import pytest
import typer.main
import yaml
from pydantic import AliasChoices
from pydantic_settings import BaseSettings
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.shared.embedded import find_nats_server
from switchyard.shared.nats_auth import gateway_user

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
DOCKERFILE = INFRA / "container" / "Dockerfile"
COMPOSE_DIR = INFRA / "compose"
CHART = INFRA / "helm" / "switchyard"
#: The long-running services every deployment must run (and probe).
SERVICES = ("router", "placement", "migration", "api", "gateway")
SOURCE_ROOTS = ("shared", "services", "engine_agents", "solver", "simulator")


# ---------------------------------------------------------------------------------------------------------------
# What the code says


def settings_classes() -> list[type[BaseSettings]]:
    """Every pydantic-settings class in the package (each module that subclasses BaseSettings is imported)."""
    for root in SOURCE_ROOTS:
        for path in (REPO / root).rglob("*.py"):
            if "(BaseSettings)" in path.read_text():
                module = ".".join(path.relative_to(REPO).with_suffix("").parts)
                importlib.import_module(f"switchyard.{module}")
    found, todo = [], list(BaseSettings.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__.startswith("switchyard.")]


def setting_names() -> set[str]:
    """The environment variable names the settings classes read (prefix + field, or the field's aliases)."""
    names = set()
    for cls in settings_classes():
        prefix = cls.model_config.get("env_prefix", "")
        for name, info in cls.model_fields.items():
            alias = info.validation_alias
            if isinstance(alias, AliasChoices):
                names.update(str(choice).upper() for choice in alias.choices)
            elif isinstance(alias, str):
                names.add(alias.upper())
            else:
                names.add(f"{prefix}{name}".upper())
    return names


def cli_options() -> dict[str, set[str]]:
    """`switchyard` subcommands (`db upgrade` as "db upgrade") and the option names each takes."""
    commands: dict[str, set[str]] = {}

    def walk(group: Any, prefix: str) -> None:
        for name, command in group.commands.items():
            full = f"{prefix}{name}"
            commands[full] = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
            if hasattr(command, "commands"):
                walk(command, f"{full} ")

    walk(typer.main.get_command(app), "")
    return commands


def http_paths(command: str) -> set[str]:
    """The HTTP paths the process that `switchyard <command>` runs serves (bus-only services: their metrics)."""
    if command == "gateway":
        from switchyard.services.gateway.app import build_app

        return {route.path for route in build_app(None).rest.routes}
    if command == "api":
        from switchyard.services.api.app import create_app
        from switchyard.services.api.settings import ApiSettings
        from switchyard.shared.settings import SwitchyardSettings

        return set(create_app(SwitchyardSettings(), ApiSettings()).openapi()["paths"])
    if command == "fleet":
        source = (REPO / "engine_agents" / "sim" / "live" / "http_server.py").read_text()
        return set(re.findall(r'Route\("([^"]+)"', source))
    settings = {c.__name__: c for c in settings_classes()}[f"{command.capitalize()}Settings"]
    # `services.runtime.metrics_endpoint`: prometheus_client's server, on SWITCHYARD_<SERVICE>_METRICS_PORT.
    return {"/metrics"} if "metrics_port" in settings.model_fields else set()


def grpc_health(command: str) -> set[str]:
    """The gRPC health services the process that `switchyard <command>` runs serves (the endpoint picker's)."""
    if command == "epp":
        from switchyard.services.epp.server import EXT_PROC, LIVENESS, READINESS

        return {LIVENESS, READINESS, EXT_PROC}
    return set()


# ---------------------------------------------------------------------------------------------------------------
# The checks (each returns its problems, so the tests can also run them on broken copies)


def check_command(args: list[str], commands: dict[str, set[str]]) -> list[str]:
    """`switchyard *args` names a real command and only options it takes."""
    name = f"{args[0]} {args[1]}" if args[:1] == ["db"] and len(args) > 1 else args[0]
    if name not in commands:
        return [f"switchyard {name}: no such command"]
    options = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    return [f"switchyard {name} {opt}: no such option" for opt in sorted(options - commands[name])]


def check_env(env: dict[str, Any], args: list[str], names: set[str]) -> list[str]:
    """Every variable is a real setting, or one the command line uses as `$(NAME)` (Kubernetes expansion)."""
    used_in_args = {m for a in args for m in re.findall(r"\$\((\w+)\)", a)}
    return [f"{key}: not a Switchyard setting" for key in env if key not in names and key not in used_in_args]


def check_values(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The settings classes accept these values (a port that is not a number, a bad mode, ... fail here)."""
    problems = []
    with monkeypatch.context() as patch:
        for key, value in env.items():
            if isinstance(value, (str, int, float)):
                patch.setenv(key, str(value))
        for cls in settings_classes():
            try:
                cls(_env_file=None)  # type: ignore[call-arg]
            except Exception as exc:
                problems.append(f"{cls.__name__}: {exc}")
    return problems


def listen_port(command: str, env: dict[str, Any]) -> tuple[int | None, list[str]]:
    """The port a service's env makes it listen on for HTTP (probes, Prometheus), and problems with its host."""
    name = command.upper()
    for key in (f"SWITCHYARD_{name}_METRICS_PORT", f"SWITCHYARD_{name}_PORT"):
        if key in env:  # a metrics port's host is its own setting, or the service's (the picker's HTTP port)
            host = env.get(key.replace("_PORT", "_HOST"), env.get(f"SWITCHYARD_{name}_HOST"))
            problems = [] if host == "0.0.0.0" else [f"{command}: {key} set but its host is {host!r}, not 0.0.0.0"]
            return int(env[key]), problems
    return None, []


# ---------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def names() -> set[str]:
    return setting_names()


@pytest.fixture(scope="module")
def commands() -> dict[str, set[str]]:
    return cli_options()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def switchyard_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Compose services that run the Switchyard image with its entrypoint (the command picks the service)."""
    return {
        name: svc
        for name, svc in compose["services"].items()
        if svc.get("image", "").startswith("switchyard:") and "entrypoint" not in svc
    }


def script_invocations(text: str) -> list[list[str]]:
    """`switchyard ...` command lines inside a shell script."""
    return [shlex.split(line.strip())[1:] for line in text.splitlines() if line.strip().startswith("switchyard ")]


# ---------------------------------------------------------------------------------------------------------------
# Files and the image


def test_every_yaml_file_parses() -> None:
    files = [p for p in INFRA.rglob("*.y*ml") if "templates" not in p.parts]
    assert {p.name for p in files} >= {"compose.yaml", "prometheus.yml", "datasources.yml", "Chart.yaml", "values.yaml"}
    for path in files:
        text = path.read_text()
        if path.parent.name == "envoy":  # string.Template files (infra/envoy/README.md): any value fills a field
            text = re.sub(r"\$\{\w+\}", "0", text)
        assert yaml.safe_load(text), path


def test_dockerfile_installs_the_package_and_runs_the_cli() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.MULTILINE)
    assert 'ENTRYPOINT ["switchyard"]' in text
    # the console script the entrypoint names is the package's
    assert re.search(r'^switchyard = "switchyard\.cli:main"$', (REPO / "pyproject.toml").read_text(), re.M)
    # every folder setup.py installs is copied in
    roots = re.search(r"ROOTS = \(([^)]*)\)", (REPO / "setup.py").read_text())
    assert roots is not None
    for root in re.findall(r'"(\w+)"', roots.group(1)):
        assert re.search(rf"^COPY {root} \./{root}$", text, re.MULTILINE), f"Dockerfile does not copy {root}/"
    env = dict(re.findall(r"^ENV (SWITCHYARD_\w+)=(\S+)$", text, re.MULTILINE))
    assert env and check_env(env, [], setting_names()) == []
    cmd = re.search(r"^CMD (\[.*\])$", text, re.MULTILINE)
    assert cmd is not None
    assert CliRunner().invoke(app, yaml.safe_load(cmd.group(1))).exit_code == 0


# ---------------------------------------------------------------------------------------------------------------
# Compose


def test_compose_runs_the_whole_shape(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert [services[f"nats-{i}"]["image"] for i in (1, 2, 3)] == ["nats:2.10"] * 3
    assert services["postgres"]["image"] == "postgres:16"
    assert {"prometheus", "grafana"} <= set(services)
    run = {svc["command"][0] for svc in switchyard_services(compose).values()}
    assert set(SERVICES) | {"fleet"} <= run


def test_compose_provisions_prometheus_and_the_dashboard(compose: dict[str, Any]) -> None:
    """Grafana starts with the Prometheus data source and the Switchyard dashboard: every file its volumes mount
    exists, the dashboard provider reads the folder the dashboard is mounted into, and the dashboard's data source
    variable is Prometheus."""
    import json

    grafana = compose["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target = volume.split(":")[:2]
        assert (COMPOSE_DIR / source).resolve().is_file(), source
        mounts[target] = (COMPOSE_DIR / source).resolve()
    provider_file = mounts["/etc/grafana/provisioning/dashboards/dashboards.yml"]
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    dashboards = [path for target, path in mounts.items() if target.startswith(provider["options"]["path"] + "/")]
    assert [p.name for p in dashboards] == ["switchyard-dashboard.json"]
    dashboard = json.loads(dashboards[0].read_text())
    assert dashboard["uid"] == "switchyard-overview"
    datasources = yaml.safe_load(mounts["/etc/grafana/provisioning/datasources/datasources.yml"].read_text())
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    assert "prometheus" in compose["services"]


def test_compose_commands_exist(compose: dict[str, Any], commands: dict[str, set[str]]) -> None:
    problems = []
    for svc in switchyard_services(compose).values():
        problems += check_command(svc["command"], commands)
    script = compose["services"]["secrets"]["command"][0]
    invocations = script_invocations(script)
    assert invocations, "the secrets service runs no switchyard command"
    for args in invocations:
        problems += check_command(args, commands)
    assert problems == []
    # the check can fail: a command or an option the CLI lacks
    assert check_command(["routr"], commands) == ["switchyard routr: no such command"]
    assert check_command(["fleet", "--http-hots", "x"], commands) == ["switchyard fleet --http-hots: no such option"]


def test_compose_env_is_real_settings(
    compose: dict[str, Any], names: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = switchyard_services(compose)
    for name, svc in services.items():
        env = svc["environment"]
        assert check_env(env, svc["command"], names) == [], name
        assert check_values(env, monkeypatch) == [], name
    # the same checks catch a misspelt setting and a value the settings refuse
    broken = copy.deepcopy(services["gateway"])
    broken["environment"]["SWITCHYARD_GATEWAY_PROT"] = "8000"
    broken["environment"]["SWITCHYARD_GATEWAY_MODE"] = "sideways"
    assert check_env(broken["environment"], broken["command"], names) == [
        "SWITCHYARD_GATEWAY_PROT: not a Switchyard setting"
    ]
    assert [p.split(":")[0] for p in check_values(broken["environment"], monkeypatch)] == ["GatewaySettings"]


def test_compose_ports_and_health_paths_match_the_code(compose: dict[str, Any]) -> None:
    services = switchyard_services(compose)
    prometheus = yaml.safe_load((COMPOSE_DIR / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for cfg in job["static_configs"] for t in cfg["targets"]}
    for name in SERVICES:
        svc = services[name]
        port, problems = listen_port(name, svc["environment"])
        assert problems == [] and port is not None, (name, problems)
        assert f"{name}:{port}" in targets, f"prometheus does not scrape {name}:{port}"
        url = urlparse(re.search(r"http://[^'\"]+", " ".join(svc["healthcheck"]["test"])).group(0))  # type: ignore[union-attr]
        assert url.port == port and url.path in http_paths(name), (name, url)
        for published in svc.get("ports", []):
            assert published.split(":")[-1] == str(port), (name, published)
    assert len(targets) == len(SERVICES)
    # the fleet's health check is on its first engine's HTTP port, under the name its hellos announce
    fleet = services["fleet"]
    args = fleet["command"]
    url = urlparse(re.search(r"http://[^'\"]+", " ".join(fleet["healthcheck"]["test"])).group(0))  # type: ignore[union-attr]
    assert url.hostname == args[args.index("--http-host") + 1] == fleet["hostname"]
    assert url.port == int(args[args.index("--http-port") + 1]) and url.path in http_paths("fleet")
    # the check can fail: a metrics port left on loopback
    assert listen_port("router", {"SWITCHYARD_ROUTER_METRICS_PORT": "9101"})[1] != []


def test_compose_nats_cluster_configs_are_valid(compose: dict[str, Any], tmp_path: Path) -> None:
    """The secrets service's `nats-config` output, included by each node's config, passes `nats-server -t`; its
    users match the fleet's engine ids and the gateway's id."""
    (args,) = script_invocations(compose["services"]["secrets"]["command"][0])
    args[args.index("--out") + 1] = str(tmp_path / "secrets")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    services = switchyard_services(compose)
    fleet = services["fleet"]["command"]
    prefill, decode = int(fleet[fleet.index("--prefill") + 1]), int(fleet[fleet.index("--decode") + 1])
    expected = [f"sim-p{i}" for i in range(prefill)] + [f"sim-d{i}" for i in range(decode)]
    assert args[args.index("--fleet-engines") + 1].split(",") == expected
    assert args[args.index("--gateways") + 1] == services["gateway"]["environment"]["SWITCHYARD_GATEWAY_GATEWAY_ID"]
    nats_server = str(find_nats_server())
    for i in (1, 2, 3):
        node = compose["services"][f"nats-{i}"]
        mounts = dict(v.split(":")[:2] for v in node["volumes"])
        conf = (COMPOSE_DIR / f"./nats/nats-{i}.conf").read_text()
        assert mounts[f"./nats/nats-{i}.conf"] == node["command"][-1] == "/etc/nats/nats.conf"
        assert mounts["secrets"] == "/etc/nats/secrets" and 'include "secrets/nats-server.conf"' in conf
        assert f"server_name: nats-{i}" in conf
        assert all(f"nats://nats-{j}:6222" in conf for j in (1, 2, 3))
        (tmp_path / "nats.conf").write_text(conf)
        check = subprocess.run([nats_server, "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr + check.stdout
    # nats-server -t does fail on a broken config
    (tmp_path / "nats.conf").write_text('include "secrets/missing.conf"\n')
    assert subprocess.run([nats_server, "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True).returncode != 0


# ---------------------------------------------------------------------------------------------------------------
# Helm


#: The Kubernetes version the rendered objects are validated against (kubernetes-validate's schemas).
KUBE_VERSION = "1.33"


def render_chart(chart: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart rendered by Helm (release `switchyard`), as objects; `values` replace the chart's defaults."""
    loaded = helm.Chart.load(str(chart))
    try:
        files = loaded.render(values, name="switchyard", namespace="default", is_install=True)
    finally:
        loaded.close()
    return [obj for text in files.values() for obj in yaml.safe_load_all(text) if obj]


def schema_problems(objects: list[dict[str, Any]]) -> list[str]:
    """Objects Kubernetes' own schemas refuse (strict: unknown fields too); custom resources are not checked."""
    problems = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            if "." not in obj["apiVersion"].split("/")[0]:  # a core kind without a schema is a typo, not a CRD
                problems.append(f"{obj['kind']} {obj['apiVersion']}: no such Kubernetes kind")
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")
    return problems


def check_chart(
    objects: list[dict[str, Any]], values: dict[str, Any], names: set[str], commands: dict[str, set[str]]
) -> list[str]:
    """Problems in the rendered objects: missing fields, commands, settings, ports, probes, Secrets, selectors."""
    problems = []
    for obj in objects:
        if not (obj.get("apiVersion") and obj.get("kind") and obj.get("metadata", {}).get("name")):
            problems.append(f"object without apiVersion/kind/metadata.name: {obj}")
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    secrets = {s["name"] for s in values["secrets"].values()}
    for workload in workloads:
        name, pod = workload["metadata"]["name"], workload["spec"]["template"]
        if workload["spec"]["selector"]["matchLabels"].items() - pod["metadata"]["labels"].items():
            problems.append(f"{name}: selector does not match its pods")
        if workload["kind"] == "StatefulSet":
            governing = services.get(workload["spec"].get("serviceName"))
            if governing is None or governing["spec"].get("clusterIP") != "None":
                problems.append(f"{name}: serviceName is no headless Service")
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        for container in pod["spec"]["containers"]:
            args, command = container["args"], container["args"][0]
            problems += check_command(args, commands)
            env = {e["name"]: e.get("value") for e in container["env"]}
            problems += check_env(env, args, names)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            port, host_problems = listen_port(command, env)
            problems += host_problems
            if port is not None and port != ports.get("http"):
                problems.append(f"{name}: listens on {port}, container port http is {ports.get('http')}")
            if not container.get("image"):
                problems.append(f"{name}: no image")
            for probe in ("livenessProbe", "readinessProbe"):
                get, grpc = container.get(probe, {}).get("httpGet"), container.get(probe, {}).get("grpc")
                if grpc is not None:  # gRPC health: a numbered container port, a service the process serves
                    if grpc["port"] not in ports.values() or grpc.get("service") not in grpc_health(command):
                        problems.append(f"{name}: {probe} gRPC {grpc.get('service')} on {grpc['port']} is not served")
                elif get is None:
                    problems.append(f"{name}: no {probe}")
                elif get["port"] not in ports or get["path"] not in http_paths(command):
                    problems.append(f"{name}: {probe} {get['path']} on {get['port']} is not served")
            for e in container["env"]:
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] not in secrets:
                    problems.append(f"{name}: {e['name']} from unknown Secret {ref['name']}")
            mounts = {m["mountPath"]: volumes.get(m["name"]) for m in container["volumeMounts"]}
            for key in ("SWITCHYARD_NATS_CREDENTIALS", "SWITCHYARD_ARTIFACT_KEY_FILE", "SWITCHYARD_ENGINE_MANIFEST"):
                path = Path(env.get(key) or "")
                volume = mounts.get(str(path.parent))
                if volume is None or volume.get("secret", {}).get("secretName") not in secrets:
                    problems.append(f"{name}: {key}={path} is not in a mounted Secret")
            if container.get("securityContext", {}).get("readOnlyRootFilesystem"):
                for writable in ("/tmp", "/var/lib/switchyard"):  # the state folder (the image's data dir) and /tmp
                    if "emptyDir" not in (mounts.get(writable) or {}):
                        problems.append(f"{name}: read-only root filesystem but {writable} is not writable")
        service = services.get(name)
        if service is None:
            problems.append(f"{name}: no Service")
        elif service["spec"]["selector"].items() - pod["metadata"]["labels"].items():
            problems.append(f"{name}: its Service selects other pods")
    return problems + schema_problems(objects)


def test_helm_lints_the_chart() -> None:
    """Helm's own `helm lint --strict`: no error and no warning (an info, such as 'icon is recommended', may stay)."""
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_chart_renders_valid_objects(
    values: dict[str, Any], names: set[str], commands: dict[str, set[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render_chart(CHART, values)
    assert check_chart(objects, values, names, commands) == []
    for obj in objects:
        for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
            assert check_values(env, monkeypatch) == [], obj["metadata"]["name"]
    workloads = {
        o["spec"]["template"]["spec"]["containers"][0]["args"][0]: o for o in objects if "template" in o.get("spec", {})
    }
    assert set(workloads) == set(SERVICES)  # the fleet is off by default
    # one Service per component, and the gateway's headless governing Service
    assert sum(o["kind"] == "Service" for o in objects) == len(SERVICES) + 1
    assert {o["kind"] for o in objects} == {"Deployment", "StatefulSet", "Service", "ServiceAccount"}
    # the API reads its token from a Secret; the database users its URL
    for command, secret_env in (
        ("api", {"SWITCHYARD_API_TOKEN", "SWITCHYARD_DATABASE_URL"}),
        ("placement", {"SWITCHYARD_DATABASE_URL"}),
        ("migration", {"SWITCHYARD_DATABASE_URL"}),
    ):
        env = workloads[command]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {e["name"] for e in env if "secretKeyRef" in e.get("valueFrom", {})} == secret_env, command
    # each gateway replica's id is its pod name, a valid NATS user name for `nats-config --gateways`
    gateway = workloads["gateway"]
    assert gateway["kind"] == "StatefulSet"
    assert gateway_user(f"{gateway['metadata']['name']}-{gateway['spec']['replicas'] - 1}")


def test_chart_values_follow_the_usual_knobs(values: dict[str, Any]) -> None:
    """Per-component image, scheduling and resources override the global ones; a ServiceMonitor per component when
    asked for; no ServiceAccount created when told not to."""
    tuned = copy.deepcopy(values)
    router = tuned["components"]["router"]
    router["image"] = {"tag": "9.9.9"}
    router["nodeSelector"] = {"pool": "cpu"}
    tuned["tolerations"] = [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    tuned["serviceMonitor"]["enabled"] = True
    tuned["serviceAccount"] = {**tuned["serviceAccount"], "create": False, "name": "existing"}
    objects = render_chart(CHART, tuned)
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if "template" in o.get("spec", {})}
    assert pods["switchyard-router"]["containers"][0]["image"] == "switchyard:9.9.9"
    assert pods["switchyard-api"]["containers"][0]["image"] == "switchyard:0.1.0"
    assert pods["switchyard-router"]["nodeSelector"] == {"pool": "cpu"} and "nodeSelector" not in pods["switchyard-api"]
    assert all(pod["tolerations"] == tuned["tolerations"] for pod in pods.values())
    assert {pod["serviceAccountName"] for pod in pods.values()} == {"existing"}
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == len(SERVICES) and "ServiceAccount" not in {o["kind"] for o in objects}
    assert schema_problems(objects) == []


def test_chart_renders_the_fleet_when_enabled(
    values: dict[str, Any], names: set[str], commands: dict[str, set[str]]
) -> None:
    with_fleet = copy.deepcopy(values)
    for component in with_fleet["components"].values():
        component["enabled"] = True
    objects = render_chart(CHART, with_fleet)
    assert check_chart(objects, with_fleet, names, commands) == []
    assert "switchyard-fleet" in {o["metadata"]["name"] for o in objects}


def test_chart_checks_can_fail(values: dict[str, Any], names: set[str], commands: dict[str, set[str]]) -> None:
    broken = copy.deepcopy(values)
    router = broken["components"]["router"]
    router["env"]["SWITCHYARD_ROUTER_METRIX_PORT"] = "9101"
    router["readiness"] = "/readyz"
    broken["components"]["api"]["port"] = 8081
    broken["components"]["migration"]["replicas"] = "two"  # Kubernetes' schema refuses it
    problems = check_chart(render_chart(CHART, broken), broken, names, commands)
    assert problems == [
        "switchyard-api: listens on 8080, container port http is 8081",
        "SWITCHYARD_ROUTER_METRIX_PORT: not a Switchyard setting",
        "switchyard-router: readinessProbe /readyz on http is not served",
        "Deployment switchyard-migration: 'two' is not of type 'integer', 'null'",
    ]
    # Helm refuses to render without an image tag (`required`), rather than printing an image without one (null in
    # the given values removes the chart's default, as `--set image.tag=null` does)
    broken["image"]["tag"] = None
    with pytest.raises(helm.HelmError, match=r"image\.tag is required"):
        render_chart(CHART, broken)


def test_docs_name_the_files() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    for needle in ("infra/container/Dockerfile", "infra/compose/compose.yaml", "infra/helm/switchyard", "nats-config"):
        assert needle in text


def doc_settings(text: str) -> set[str]:
    """`SWITCHYARD_*` names a page spells out in full (`SWITCHYARD_<SERVICE>_...` patterns and prefixes skipped)."""
    return set(re.findall(r"\bSWITCHYARD_[A-Z0-9_]*[A-Z0-9]\b(?![<_])", text))


def doc_commands(text: str) -> list[list[str]]:
    """`switchyard ...` lines of a page's shell code blocks (continuations joined, `NAME=value` prefixes dropped)."""
    blocks = [block.replace("\\\n", " ") for block in re.findall(r"```sh\n(.*?)```", text, re.S)]
    lines = [line for block in blocks for line in block.splitlines()]
    found = []
    for line in lines:
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words = words[1:]
        if words[:1] == ["switchyard"]:
            found.append(words[1:])
    return found


def test_deploy_doc_names_real_settings_and_commands(names: set[str], commands: dict[str, set[str]]) -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    assert sorted(doc_settings(text) - names) == []
    invocations = doc_commands(text)
    assert len(invocations) >= 4  # nats-config, up (three shapes): the blocks were found
    assert [problem for args in invocations for problem in check_command(args, commands)] == []
    # the same checks catch a misspelt setting and option
    broken = "Set `SWITCHYARD_GATEWAY_GATEWAYID`.\n```sh\nX=1 switchyard nats-config --out d \\\n  --gateway g0\n```\n"
    assert doc_settings(broken) - names == {"SWITCHYARD_GATEWAY_GATEWAYID"}
    assert check_command(doc_commands(broken)[0], commands) == ["switchyard nats-config --gateway: no such option"]


def test_chart_renders_a_keda_scaled_object_on_the_gateways_signals(values: dict[str, Any]) -> None:
    """Off by default; on, one KEDA ScaledObject (no schema in kubernetes-validate: its shape checked here) whose
    Prometheus triggers query only metrics the gateway exports, with KEDA's string thresholds."""
    from prometheus_client import REGISTRY

    import switchyard.services.gateway.metrics  # noqa: F401  (registers the gateway's metrics)

    assert "ScaledObject" not in {o["kind"] for o in render_chart(CHART, values)}
    scaled = copy.deepcopy(values)
    scaled["keda"] = {**scaled["keda"], "enabled": True, "model": "deepseek-v2-lite"}
    objects = [o for o in render_chart(CHART, scaled) if o["kind"] == "ScaledObject"]
    assert len(objects) == 1
    spec = objects[0]["spec"]
    assert objects[0]["apiVersion"] == "keda.sh/v1alpha1"
    assert spec["scaleTargetRef"]["name"] == values["keda"]["scaleTargetRef"]["name"]
    assert 0 < spec["minReplicaCount"] <= spec["maxReplicaCount"]
    exported = {m.name for m in REGISTRY.collect()}
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] in ("Value", "AverageValue")
        assert urlparse(meta["serverAddress"]).scheme == "http"
        assert isinstance(meta["threshold"], str) and float(meta["threshold"]) > 0
        queried = set(re.findall(r"switchyard_[a-z_]+", meta["query"]))
        assert queried and queried <= exported, queried - exported
    assert 'model_name=~"deepseek-v2-lite"' in spec["triggers"][0]["metadata"]["query"]
