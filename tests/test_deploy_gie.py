"""The Helm chart behind a Gateway API inference gateway: the endpoint picker's StatefulSet and Service, its
InferencePool and the HTTPRoute example, rendered by Helm itself (`tests/test_deploy_material.py`'s helpers).

Kubernetes' own schemas (`kubernetes-validate`) know no custom resource, so the InferencePool is validated against
the CRD's OpenAPI schema vendored from gateway-api-inference-extension (`infra/schemas/README.md`), made strict
(Kubernetes would silently prune a misspelt field; here it is an error), plus the CRD's two CEL rules, which a JSON
Schema validator does not run.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import helm_python as helm
import jsonschema_rs
import pytest
import yaml

from switchyard.services.epp.server import LIVENESS, READINESS
from switchyard.shared.nats_auth import epp_user
from switchyard.shared.subjects import check_token
from tests.test_deploy_material import CHART, INFRA, check_chart, cli_options, render_chart, setting_names

CRD = INFRA / "schemas" / "inference.networking.k8s.io_inferencepools.yaml"


def strict(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others (`additionalProperties: false`)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    lists_properties = out.get("type") == "object" and isinstance(out.get("properties"), dict)
    open_to_more = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if lists_properties and not open_to_more:
        out["additionalProperties"] = False
    return out


def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(version["schema"]["openAPIV3Schema"])


VALIDATOR = jsonschema_rs.Draft7Validator(pool_schema())


def pool_problems(pool: dict[str, Any]) -> list[str]:
    """What the API server would refuse in an InferencePool: its schema, and its CEL rules checked by hand."""
    problems = [f"/{'/'.join(map(str, e.instance_path))}: {e.message}" for e in VALIDATOR.iter_errors(pool)]
    spec = pool.get("spec", {})
    numbers = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):  # rule: self.all(p1, self.exists_one(p2, p1.number==p2.number))
        problems.append("/spec/targetPorts: port number must be unique")
    ref = spec.get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
        problems.append("/spec/endpointPickerRef: port is required when kind is 'Service'")
    return problems


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    """The chart's values with the picker on."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["components"]["epp"]["enabled"] = True
    return values


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_the_vendored_crd_is_the_recorded_file() -> None:
    readme = (CRD.parent / "README.md").read_text()
    assert f"SHA-256: `{hashlib.sha256(CRD.read_bytes()).hexdigest()}`" in readme
    assert yaml.safe_load(CRD.read_text())["spec"]["names"]["kind"] == "InferencePool"


def test_the_picker_is_off_by_default() -> None:
    """Without the CRDs an install would fail on the InferencePool: nothing of it unless asked for."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    kinds = {o["kind"] for o in render_chart(CHART, defaults)}
    assert "InferencePool" not in kinds and "HTTPRoute" not in kinds
    assert "switchyard-epp" not in {o["metadata"]["name"] for o in render_chart(CHART, defaults)}


def test_the_picker_renders_with_its_pool_and_route(values: dict[str, Any]) -> None:
    objects = render_chart(CHART, values)
    assert check_chart(objects, values, setting_names(), cli_options()) == []
    (pool,) = by_kind(objects, "InferencePool").values()
    assert pool_problems(pool) == []
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec, epp = pool["spec"], values["components"]["epp"]
    assert spec["selector"]["matchLabels"] == values["inferencePool"]["modelServers"]["matchLabels"]
    assert [p["number"] for p in spec["targetPorts"]] == values["inferencePool"]["targetPorts"]
    # the picker reference: a rendered Service whose port of that number leads to the container's ext_proc port
    ref = spec["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["failureMode"] == "FailClose"
    service = by_kind(objects, "Service")[ref["name"]]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    workload = by_kind(objects, "StatefulSet")["switchyard-epp"]
    container = workload["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container_ports[port["targetPort"]] == int(env["SWITCHYARD_EPP_PORT"]) == epp["grpcPort"]
    assert container["args"] == ["epp"]
    # gRPC probes on that port, for the picker's liveness and readiness services
    assert container["livenessProbe"]["grpc"] == {"port": epp["grpcPort"], "service": LIVENESS}
    assert container["readinessProbe"]["grpc"] == {"port": epp["grpcPort"], "service": READINESS}
    # each replica's id is its pod name: a valid picker id and NATS user for `nats-config --epps`
    assert {"name": "SWITCHYARD_EPP_EPP_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container[
        "env"
    ]
    last = f"{workload['metadata']['name']}-{workload['spec']['replicas'] - 1}"
    assert check_token(last, "picker id") == last and epp_user(last)
    # the route's backend is the pool
    (route,) = by_kind(objects, "HTTPRoute").values()
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert route["spec"]["parentRefs"] == values["inferencePool"]["httpRoute"]["parentRefs"]


def test_pool_values_are_honoured(values: dict[str, Any]) -> None:
    tuned = copy.deepcopy(values)
    pool_values = tuned["inferencePool"]
    pool_values.update(name="moe", targetPorts=[8000, 8001], failureMode="FailOpen", appProtocol="kubernetes.io/h2c")
    pool_values["httpRoute"]["enabled"] = False
    objects = render_chart(CHART, tuned)
    pool = by_kind(objects, "InferencePool")["moe"]
    assert pool_problems(pool) == []
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c"
    assert "HTTPRoute" not in {o["kind"] for o in objects}
    # the pool may be left out while the picker runs (a pool managed elsewhere)
    pool_values["enabled"] = False
    objects = render_chart(CHART, tuned)
    assert "InferencePool" not in {o["kind"] for o in objects} and "switchyard-epp" in by_kind(objects, "Service")
    # its selector is required: Helm refuses to render without one
    tuned["inferencePool"].update(enabled=True, modelServers={"matchLabels": None})
    with pytest.raises(helm.HelmError, match="matchLabels is required"):
        render_chart(CHART, tuned)


@pytest.mark.parametrize(
    ("breakage", "problem"),
    [
        (lambda s: s["targetPorts"][0].update(numbr=8000), "'numbr' was unexpected"),
        (lambda s: s.update(targetPort=[{"number": 8000}]), "'targetPort' was unexpected"),
        (lambda s: s["targetPorts"].append({"number": 8000}), "port number must be unique"),
        (lambda s: s.update(targetPorts=[{"number": n} for n in range(8000, 8009)]), "/spec/targetPorts"),
        (lambda s: s["targetPorts"][0].update(number=70000), "/spec/targetPorts/0/number"),
        (lambda s: s["endpointPickerRef"].update(failureMode="FailSometimes"), "/spec/endpointPickerRef/failureMode"),
        (lambda s: s["endpointPickerRef"].pop("port"), "port is required"),
        (lambda s: s["selector"].update(matchLabels={}), "/spec/selector/matchLabels"),
        (lambda s: s["selector"].update(matchLabels={"app": "not a label value"}), "/spec/selector/matchLabels/app"),
        (lambda s: s.pop("selector"), "selector"),
    ],
)
def test_the_pool_check_can_fail(values: dict[str, Any], breakage: Any, problem: str) -> None:
    (pool,) = by_kind(render_chart(CHART, values), "InferencePool").values()
    broken = copy.deepcopy(pool)
    breakage(broken["spec"])
    problems = pool_problems(broken)
    assert any(problem in p for p in problems), problems
