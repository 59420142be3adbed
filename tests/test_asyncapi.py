"""infra/asyncapi.json: current with the code, a valid AsyncAPI 3.0.0 document, and complete.

Valid means against the official schema vendored in infra/schemas (offline: every `$ref` it makes is inside it).
Complete means every member of `Subjects` is a channel, a subscription, a queue, a stream or a bucket of the
document, every `$ref` resolves, and every role that sends or receives there holds the NATS permission to.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.engine_agents.sim.live.protocol import SimCompleted, SimSubmit
from switchyard.shared.asyncapi import build, render
from switchyard.shared.nats_auth import Permissions, Roles
from switchyard.shared.subjects import DECIDER_KINDS, Subjects

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "infra" / "asyncapi.json"
SCHEMA = REPO / "infra" / "schemas" / "asyncapi-3.0.0.json"
REGENERATE = "switchyard asyncapi --out infra/asyncapi.json"
#: Example ids for a channel's parameters.
IDS = {"engine_id": "e1", "replica_id": "r1", "reporter": "gateway-r1"}

#: Every public member of `Subjects`, by what the document must show of it.
ENGINE_SUBJECTS = {"hello", "telemetry", "signature", "kv_events", "expert_load", "migrate", "layout", "sim_submit"}
FIXED_SUBJECTS = {
    "announce",
    "routing_samples",
    "legacy_routing_samples",
    "placement_plan",
    "calibration_request",
    "route_decode",
    "route_dp",
    "sim_completed",
}
WILDCARDS = {"all_hello", "all_telemetry", "all_kv_events", "all_signatures", "all_expert_load", "route_decided"}
WILDCARDS |= {"route_progress"}
NAMES = {
    "router_queue",
    "expert_load_stream",
    "placement_stream",
    "routing_samples_stream",
    "legacy_routing_samples_stream",
    "router_bucket",
    "lease_bucket",
    "artifact_key",
}
#: Members that build or parse subjects already covered above, or list names checked through them.
OTHERS = {"prefix", "decided", "all_decided_by", "engine_of", "decider_of", "streams", "durables"}
OTHERS |= {"progress", "reporter_of"}
OTHERS |= {"migration_plans", "calibration_requests"}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return build({"SimSubmit": SimSubmit, "SimCompleted": SimCompleted})


@pytest.fixture(scope="module")
def validator() -> Any:
    def offline(uri: str) -> Any:
        raise AssertionError(f"the vendored schema should hold {uri}")

    return jsonschema_rs.Draft7Validator(json.loads(SCHEMA.read_text()), retriever=offline)


def test_the_committed_document_is_current(document: dict[str, Any]) -> None:
    stale = f"infra/asyncapi.json is stale: run `{REGENERATE}`"
    assert COMMITTED.read_text(encoding="utf-8") == render(document), stale


def test_the_command_prints_and_writes_the_document(document: dict[str, Any], tmp_path: Path) -> None:
    printed = CliRunner().invoke(app, ["asyncapi"])
    assert printed.exit_code == 0, printed.output
    assert printed.output == render(document)
    out = tmp_path / "bus.json"
    written = CliRunner().invoke(app, ["asyncapi", "--out", str(out), "--prefix", "staging"])
    assert written.exit_code == 0, written.output
    staged = json.loads(out.read_text(encoding="utf-8"))
    assert staged["channels"]["engineHello"]["address"] == "staging.engine.{engine_id}.hello"
    refused = CliRunner().invoke(app, ["asyncapi", "--prefix", "a.b"])
    assert refused.exit_code != 0 and "--prefix" in refused.output


def test_the_vendored_schema_is_the_recorded_file() -> None:
    readme = (SCHEMA.parent / "README.md").read_text()
    assert f"SHA-256: `{hashlib.sha256(SCHEMA.read_bytes()).hexdigest()}`" in readme


def test_the_document_validates(document: dict[str, Any], validator: Any) -> None:
    errors = [f"{'/'.join(map(str, e.instance_path))}: {e.message[:200]}" for e in validator.iter_errors(document)]
    assert errors == []


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d.pop("asyncapi"),
        lambda d: d.update(asyncapi="2.6.0"),
        lambda d: d["channels"]["engineHello"].update(address=7),
        lambda d: d["operations"]["sendEngineHello"].update(action="publish"),  # AsyncAPI 2's word
        lambda d: d["components"]["messages"]["Hello"].update(payload=[]),
    ],
)
def test_a_broken_document_fails_validation(document: dict[str, Any], validator: Any, breakage: Any) -> None:
    broken = json.loads(json.dumps(document))
    breakage(broken)
    assert not validator.is_valid(broken)


def _resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_every_reference_resolves_and_every_message_is_used(document: dict[str, Any]) -> None:
    refs = _refs(document)
    assert len(refs) > 100
    for ref in refs:
        _resolve(document, ref)
    messages = document["components"]["messages"]
    used = {ref.rsplit("/", 1)[1] for ref in refs if ref.startswith("#/components/messages/")}
    assert used == set(messages)
    for name, message in messages.items():
        assert message["payload"] == {"$ref": f"#/components/schemas/{name}"}
        assert message["contentType"] == "application/msgpack"


def test_arrays_are_described_as_they_travel(document: dict[str, Any]) -> None:
    counts = document["components"]["schemas"]["ExpertLoad"]["properties"]["expert_counts"]
    assert counts["type"] == "object" and counts["required"] == ["dtype", "shape", "data"]
    assert counts["properties"]["shape"]["minItems"] == counts["properties"]["shape"]["maxItems"] == 2
    dtype = re.compile(counts["properties"]["dtype"]["pattern"])
    assert dtype.match("<u2") and dtype.match("|i1") and not dtype.match("<f4") and not dtype.match(">u2")


def _pattern(address: str) -> re.Pattern[str]:
    return re.compile(re.sub(r"\\\{[a-z_]+\\\}", "[A-Za-z0-9_-]+", re.escape(address)) + "$")


def _strings(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {s for v in node.values() for s in _strings(v)}
    if isinstance(node, list):
        return {s for v in node for s in _strings(v)}
    return {node} if isinstance(node, str) else set()


def test_every_subject_is_in_the_document(document: dict[str, Any]) -> None:
    members = {name for name in vars(Subjects) if not name.startswith("_")}
    classified = ENGINE_SUBJECTS | FIXED_SUBJECTS | WILDCARDS | NAMES | OTHERS
    assert members == classified, "a new member of Subjects: put it in the document and in this test's table"
    s = Subjects()
    addresses = [_pattern(c["address"]) for c in document["channels"].values() if c["address"] is not None]
    subjects = [getattr(s, name)("e1") for name in ENGINE_SUBJECTS] + [getattr(s, name) for name in FIXED_SUBJECTS]
    subjects += [s.decided(kind, "r1") for kind in DECIDER_KINDS]
    subjects += [f"$KV.{s.router_bucket}.{s.artifact_key}"]
    for subject in subjects:
        assert any(a.match(subject) for a in addresses), f"{subject} is no channel's address"
    subscriptions = {c.get("x-switchyard-subscribe") for c in document["channels"].values()}
    for name in WILDCARDS:
        assert getattr(s, name) in subscriptions, f"{name} is no channel's subscription"
    strings = _strings(document)
    names = [getattr(s, name) for name in NAMES - {"artifact_key"}] + [d.name for d in s.durables()]
    names += [subject for subjects in s.streams().values() for subject in subjects]
    for name in names:
        assert name in strings, f"{name} is not in the document"


def _covers(permission: str, subject: str) -> bool:
    """Whether a NATS permission subject allows `subject` (itself perhaps a wildcard subscription)."""
    have, want = permission.split("."), subject.split(".")
    for i, token in enumerate(have):
        if token == ">":
            return len(want) > i
        if i >= len(want) or (token != "*" and token != want[i]) or (token == "*" and want[i] == ">"):
            return False
    return len(have) == len(want)


def _permissions(role: str) -> Permissions:
    roles = Roles(Subjects())
    if role == "engine":
        return roles.engine(IDS["engine_id"])
    if role == "fleet":
        return roles.fleet([IDS["engine_id"]])
    if role == "gateway":
        return roles.gateway(IDS["replica_id"])
    return roles.role(role)


def test_every_sender_and_receiver_holds_the_permission(document: dict[str, Any]) -> None:
    checked = 0
    for op_id, op in document["operations"].items():
        channel = _resolve(document, op["channel"]["$ref"])
        subject = channel["address"].format(**IDS)
        core = channel["x-switchyard-carrier"]["transport"] == "core NATS"
        for tag in op["tags"]:
            perms = _permissions(tag["name"])
            if op["action"] == "send":
                assert any(_covers(p, subject) for p in perms.publish), f"{op_id}: {tag['name']} may not publish"
            elif core:  # JetStream readers use consumers (tests/test_consumer_permissions.py)
                wanted = channel.get("x-switchyard-subscribe", channel["address"]).format(**IDS)
                assert any(_covers(p, wanted) for p in perms.subscribe), f"{op_id}: {tag['name']} may not subscribe"
            checked += 1
    assert checked > 50
    assert not _covers("sy.engine.*.hello", "sy.engine.>") and _covers("sy.route.decided.>", "sy.route.decided.>")
