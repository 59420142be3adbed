"""Routing-artifact persistence (file, database, JetStream KV) and the `switchyard fit` command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.services.artifacts import (
    ArtifactError,
    get_artifact_kv,
    publish_artifact,
    publish_to,
    read_artifact_file,
    write_artifact_file,
)
from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode
from switchyard.shared.db import RoutingArtifactRow, sync_url, upgrade
from switchyard.shared.routing_trace import RoutingTrace
from switchyard.shared.schemas import RoutingArtifact
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.trace_files import save_npz
from switchyard.solver.eldr_fit import fit_routing_artifact
from switchyard.solver.signatures import RequestCounts
from tests.eldr_helpers import ESFT_DIR, random_experts


@pytest.fixture(scope="module")
def fitted() -> tuple[RoutingArtifact, dict]:
    rng = np.random.default_rng(0)
    rate = (rng.random((2, 3, 6)) ** 3)[rng.integers(0, 2, 24)] * 6
    return fit_routing_artifact(RequestCounts(prefill=rng.poisson(rate), decode=rng.poisson(rate), top_k=1), 2)


def test_file_round_trip_and_tampering_is_detected(tmp_path: Path, fitted: tuple[RoutingArtifact, dict]) -> None:
    artifact, _ = fitted
    write_artifact_file(artifact, tmp_path / "a" / "artifact.msgpack")
    back = read_artifact_file(tmp_path / "a" / "artifact.msgpack")
    assert back.content_hash == artifact.content_hash
    np.testing.assert_array_equal(back.centroids, artifact.centroids)
    tampered = artifact.model_copy(update={"tau": 0.5})  # content changed, hash kept
    (tmp_path / "t.msgpack").write_bytes(encode(tampered))
    with pytest.raises(ArtifactError, match="does not match its hash"):
        read_artifact_file(tmp_path / "t.msgpack")
    (tmp_path / "junk.msgpack").write_bytes(b"\x00\x01")
    with pytest.raises(ArtifactError, match=r"junk\.msgpack"):
        read_artifact_file(tmp_path / "junk.msgpack")
    with pytest.raises(ArtifactError, match="absent"):
        read_artifact_file(tmp_path / "absent.msgpack")


def test_a_key_demands_the_fit_jobs_signature(fitted: tuple[RoutingArtifact, dict]) -> None:
    from switchyard.services.artifacts import load_artifact, sign_artifact

    artifact, _ = fitted
    key = b"a signing key of 32 bytes......."
    signed = sign_artifact(artifact, key)
    assert load_artifact(encode(signed), key=key).signature == signed.signature
    assert load_artifact(encode(artifact)).signature is None  # no key configured: unsigned is accepted
    with pytest.raises(ArtifactError, match="unsigned"):
        load_artifact(encode(artifact), key=key)
    with pytest.raises(ArtifactError, match="signature does not match"):
        load_artifact(encode(sign_artifact(artifact, b"x" * 32)), key=key)
    bumped = signed.model_copy(update={"version": signed.version + 1})  # the signature covers the version
    with pytest.raises(ArtifactError, match="signature does not match"):
        load_artifact(encode(bumped), key=key)


async def test_publish_versions_from_every_destination(
    bus: Bus, database_url: str, tmp_path: Path, fitted: tuple[RoutingArtifact, dict]
) -> None:
    artifact, report = fitted
    upgrade(database_url)
    assert await get_artifact_kv(bus) is None
    first = await publish_artifact(artifact, report, out=tmp_path / "a.msgpack", database_url=database_url, bus=bus)
    second = await publish_artifact(artifact, report, database_url=database_url, bus=bus)
    assert (first.version, second.version) == (1, 2)
    current = await get_artifact_kv(bus)
    assert current is not None and current.version == 2 and current.content_hash == artifact.content_hash
    # A file holding version 7 raises the next version to 8.
    write_artifact_file(artifact.model_copy(update={"version": 7}), tmp_path / "b.msgpack")
    third = await publish_artifact(artifact, report, out=tmp_path / "b.msgpack", database_url=database_url)
    assert third.version == 8 and read_artifact_file(tmp_path / "b.msgpack").version == 8
    engine = create_engine(sync_url(database_url))
    with Session(engine) as session:
        rows = session.scalars(select(RoutingArtifactRow).order_by(RoutingArtifactRow.version)).all()
        assert [r.version for r in rows] == [1, 2, 8]
        assert rows[0].num_decoders == 2 and rows[0].layer_mask == artifact.layer_mask
        assert rows[0].report["cluster_sizes"] == report["cluster_sizes"]
    engine.dispose()


async def test_publish_to_connects_only_where_asked(
    settings: SwitchyardSettings, tmp_path: Path, fitted: tuple[RoutingArtifact, dict], bus: Bus
) -> None:
    artifact, report = fitted
    url = f"sqlite:///{tmp_path / 'fresh.sqlite'}"  # no schema yet: publish_to upgrades it
    stored = await publish_to(artifact, report, settings, database_url=url, nats_servers=settings.nats_servers)
    assert stored.version == 1
    current = await get_artifact_kv(bus)
    assert current is not None and current.version == 1


def _tiny_trace(path: Path) -> Path:
    rng = np.random.default_rng(3)
    lengths = rng.integers(4, 20, 30)
    save_npz(RoutingTrace(random_experts(rng, int(lengths.sum()), 3, 8, 2), np.repeat(np.arange(30), lengths), 8), path)
    return path


def test_cli_fit_prints_the_report_contract_and_writes_the_artifact(tmp_path: Path) -> None:
    trace = _tiny_trace(tmp_path / "trace.npz")
    out = tmp_path / "artifact.msgpack"
    result = CliRunner().invoke(
        app, ["fit", "--trace", str(trace), "--format", "npz", "--decoders", "3", "--out", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for key in ("rho", "layer_mask", "rho_by_num_layers", "cluster_sizes", "fit_seconds"):
        assert key in report
    assert set(report["rho"]) == {"count", "count_idf", "binary"}  # no gate weights in this trace
    artifact = read_artifact_file(out)
    assert artifact.version == report["version"] == 1 and artifact.layer_mask == report["layer_mask"]
    text = CliRunner().invoke(app, ["fit", "--trace", str(trace), "--decoders", "3", "--layers", "0,2"])
    assert text.exit_code == 0 and "layers [0, 2]" in text.stdout
    assert "nothing written" in text.stdout  # no --out, database or bus: the user is told the fit was not kept


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decoders", "3", "--format", "esft"], "missing array"),
        (["--decoders", "31"], "usable calibration requests"),
        (["--decoders", "3", "--prefill-fraction", "1.5"], "strictly between"),
        (["--decoders", "3", "--representation", "gate_prob"], "representation"),
        (["--decoders", "3", "--layers", "0,x"], "invalid literal"),
    ],
)
def test_cli_fit_reports_bad_input_without_a_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["fit", "--trace", str(_tiny_trace(tmp_path / "t.npz")), *args])
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


def test_cli_fit_on_esft_auto_detects_the_format(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["fit", "--trace", str(ESFT_DIR), "--decoders", "4", "--json", "--vanilla"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"]["name"] == "DeepSeek-V2-Lite" and len(report["cluster_sizes_vanilla"]) == 4


def test_cli_fit_reports_an_unreachable_destination_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_NATS_INITIAL_CONNECT_S", "0.3")
    trace = str(_tiny_trace(tmp_path / "t.npz"))
    result = CliRunner().invoke(app, ["fit", "--trace", trace, "--decoders", "3", "--nats-url", "nats://127.0.0.1:9"])
    assert result.exit_code == 1 and "cannot reach NATS" in result.stderr
    (tmp_path / "dir.msgpack").mkdir()
    result = CliRunner().invoke(
        app, ["fit", "--trace", trace, "--decoders", "3", "--out", str(tmp_path / "dir.msgpack")]
    )
    assert result.exit_code == 1 and "could not store" in result.stderr
