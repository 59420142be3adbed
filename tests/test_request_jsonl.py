"""The JSONL request-trace shape: parsing, its errors (file:line), format sniffing, the shipped Mooncake trace."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.simulator.core.request_jsonl import read_request_jsonl
from switchyard.simulator.core.workload import build_workload, load_requests
from tests.conftest import SHIPPED_DATA

MOONCAKE = SHIPPED_DATA / "requests" / "mooncake_fast25" / "synthetic_trace.jsonl"


def _write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_parses_and_sorts_by_time(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            '{"timestamp": 1500, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]}',
            "",
            '{"timestamp": 500, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]}',
        ],
    )
    trace = load_requests(path)
    assert trace.arrival.tolist() == [0.0, 1.0]
    assert trace.prompt.tolist() == [600, 1024] and trace.output.tolist() == [2, 3]
    assert trace.hash_ids is not None and [h.tolist() for h in trace.hash_ids] == [[0, 2], [0, 1]]
    assert trace.hash_block == 512


def test_without_hash_ids_there_are_none(tmp_path: Path) -> None:
    path = _write(tmp_path, ['{"timestamp": 0, "input_length": 10, "output_length": 1}'], name="plain.txt")
    trace = load_requests(path)  # sniffed by content, not extension
    assert trace.hash_ids is None and trace.hash_block == 0


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 5, "output_length": 1}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "'input_length'"),
        ('{"timestamp": 0, "input_length": 5, "output_length": "x"}', "'output_length'"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}', "'hash_ids'"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1}'
    path = _write(tmp_path, [good, line])
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: .*{reason}"):
        read_request_jsonl(path)


def test_empty_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        read_request_jsonl(_write(tmp_path, [""]))


def test_cli_reports_a_bad_line_without_traceback(tmp_path: Path) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1}'
    path = _write(tmp_path, [good, good, "{oops"])
    result = CliRunner().invoke(app, ["sim-dp", "--requests", str(path), "--num-requests", "2"])
    assert result.exit_code == 2
    assert "t.jsonl:3: not JSON" in result.output and "Traceback" not in result.output


def test_shipped_mooncake_trace_loads() -> None:
    sums = dict(
        reversed(line.split(maxsplit=1)) for line in (SHIPPED_DATA / "SHA256SUMS").read_text().splitlines() if line
    )
    digest = hashlib.sha256(MOONCAKE.read_bytes()).hexdigest()
    assert sums["requests/mooncake_fast25/synthetic_trace.jsonl"] == digest, "byte-identical to the source"
    trace = load_requests(MOONCAKE)
    assert len(trace.arrival) == 3993 and trace.hash_block == 512
    assert trace.hash_ids is not None
    assert all(len(h) == -(-int(p) // 512) for h, p in zip(trace.hash_ids, trace.prompt, strict=True))
    assert 1000 < trace.duration < 1100  # ~1,022 s of Poisson arrivals
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert trace.prompt[0] == first["input_length"]


def test_workload_carries_hash_ids_and_cycles_them() -> None:
    trace = load_requests(MOONCAKE)
    wl = build_workload(
        len(trace.arrival) + 2, np.arange(4), np.ones(4), np.ones(4), seed=0, requests=trace, time_scale=1.0
    )
    assert wl.hash_ids is not None and wl.hash_block == 512
    assert wl.hash_ids[-1] is trace.hash_ids[1], "a cycled request is the same request: same prefix"
