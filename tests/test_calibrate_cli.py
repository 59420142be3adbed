"""`switchyard calibrate`: recorded windows in, one calibrations row out, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.services.calibration import WindowError, load_window, sglang_windows, window_problem
from switchyard.shared.codec import encode
from switchyard.shared.db import Calibration, sync_url
from switchyard.shared.schemas import ExpertLoad
from switchyard.solver.placement import Weights
from tests.conftest import SHIPPED_DATA

SGLANG = SHIPPED_DATA / "expert_load" / "sglang_deepseek_v3"
FAST = ["--time-limit", "0.2", "--parallel-layers", "2", "--json"]


def _run(*args: str) -> dict:
    result = CliRunner().invoke(app, ["calibrate", *args])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    # progress on stderr: one line per MINLP solve, two per window, ending at the total
    progress = [line.split()[0] for line in result.stderr.splitlines() if line.startswith("[")]
    total = 2 * summary["num_windows"]
    assert progress == [f"[{i}/{total}]" for i in range(1, total + 1)], result.stderr
    return summary


def test_calibrate_on_recorded_windows_persists_one_row(database_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(2):  # one window as .npz with a recorded placement, one as an ExpertLoad message
        counts = rng.integers(0, 500, (3, 2, 16))
        if i == 0:
            placement = np.arange(16)[rng.permutation(16)].reshape(1, 4, 4).repeat(3, axis=0)
            np.savez(tmp_path / "w0.npz", source_counts=counts, placement=placement)
            paths.append(tmp_path / "w0.npz")
        else:
            message = ExpertLoad(
                engine_id="e1",
                ep_group="g",
                seq=7,
                window_start=0.0,
                window_end=1.0,
                expert_counts=counts.sum(axis=1).astype(np.uint32),
                source_counts=counts.astype(np.uint32),
            )
            (tmp_path / "w1.msgpack").write_bytes(encode(message))
            paths.append(tmp_path / "w1.msgpack")
    args = [a for p in paths for a in ("--windows", str(p))]
    summary = _run(*args, "--database-url", database_url, "--engine-group", "g", *FAST)
    assert summary["num_windows"] == 2 and 0.0 <= summary["agreement"] <= 1.0
    engine = create_engine(sync_url(database_url))
    with Session(engine) as session:
        rows = session.scalars(select(Calibration)).all()
    engine.dispose()
    assert len(rows) == 1
    row = rows[0]
    assert (row.id, row.engine_group, row.status) == (summary["id"], "g", "succeeded")
    assert row.params == {"comm": summary["alpha"], "load": summary["beta"], "mig": summary["gamma"]}
    assert row.agreement == summary["agreement"] and row.comm_gap == summary["comm_gap"]
    assert row.solve_seconds > 0 and len(row.details["windows"]) == 2
    assert row.details["setup"]["windows"] == ["w0", "e1:7"]


def test_calibrate_reads_the_sglang_statistics(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cal.sqlite'}"
    summary = _run("--windows", str(SGLANG), "--layers", "2", "--experts", "32", "--database-url", url, *FAST)
    assert summary["num_windows"] == 3  # one decode and two prefill windows of four workloads each
    assert summary["comm_gap"] > -1 and summary["solve_seconds"] > 0
    for method in ("greedy", "place", "keep_layout", "eplb"):
        assert {"objective_gap", "agreement", "agreement_moved", "comm_gap"} <= set(summary[method]), method
    assert summary["place"]["agreement"] == summary["agreement"]
    assert summary["keep_layout"]["objective_gap"] > summary["place"]["objective_gap"]
    assert summary["weights"]["paper"] == {**summary["weights"]["paper"], "alpha": 1.0, "beta": 0.0025, "gamma": 1.0}


def test_sglang_windows_use_workloads_as_equal_volume_sources() -> None:
    windows = sglang_windows(SGLANG, sources_per_window=4)
    assert [w.name.split(":")[0] for w in windows] == ["decode", "prefill", "prefill"]
    volume = windows[0].source_counts.sum(axis=2)
    np.testing.assert_allclose(volume, volume[:, :1].repeat(4, axis=1))  # equal tokens per source and layer
    assert windows[0].source_counts.shape == (58, 4, 256)  # the 3 dense layers are dropped
    problem = window_problem(windows[0], 8, migration_cost=0.01, weights=Weights(), layers=4, experts=64)
    assert problem.shape == (4, 64, 8) and problem.distance.tolist()[0] == [0, 0, 1, 1, 1, 1, 1, 1]


def test_bad_windows_fail_with_a_message_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    (tmp_path / "empty.npz").write_bytes(b"")
    np.savez(tmp_path / "nocounts.npz", other=np.ones(3))
    for name, message in [("bad.npz", "bad.npz"), ("nocounts.npz", "source_counts"), ("missing.npz", "No such file")]:
        result = CliRunner().invoke(app, ["calibrate", "--windows", str(tmp_path / name), "--data-dir", str(tmp_path)])
        assert result.exit_code == 2, result.output
        assert message in result.output
    with pytest.raises(WindowError, match="unknown window format"):
        load_window(tmp_path / "x.csv")
