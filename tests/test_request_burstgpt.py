"""BurstGPT request CSVs: read by header (any release), zero-token rows dropped with a count, errors by line,
the shipped excerpt byte-identical to its source and loaded by `--requests`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.simulator.core.request_burstgpt import read_burstgpt_csv
from switchyard.simulator.core.workload import build_workload, load_requests
from tests.conftest import SHIPPED_DATA

BURSTGPT = SHIPPED_DATA / "requests" / "burstgpt" / "BurstGPT_1_first400.csv"
HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


def _write(tmp_path: Path, lines: list[str], name: str = "b.csv") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_zero_token_rows_are_dropped_and_counted(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            HEADER,
            "5,ChatGPT,472,18,490,Conversation log",
            "7,ChatGPT,0,0,0,Conversation log",  # a failed request
            "9,GPT-4,300,0,300,API log",  # no response: a failure too
            "12,GPT-4,120,40,160,API log",
        ],
    )
    cols = read_burstgpt_csv(path)
    assert cols.rows == 4 and cols.dropped == 2
    assert cols.prompt.tolist() == [472, 120] and cols.output.tolist() == [18, 40]
    trace = load_requests(path)  # by content: a CSV whose header is BurstGPT's
    assert trace.dropped == 2 and trace.arrival.tolist() == [0.0, 7.0]
    wl = build_workload(2, np.arange(2), np.ones(2), np.ones(2), seed=0, requests=trace)
    assert "2 zero-token rows dropped" in wl.description


def test_burstgpt_3_columns_are_found_by_name(tmp_path: Path) -> None:
    header = "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type"
    path = _write(tmp_path, [header, "3,abc,2.5,ChatGPT,10,20,30,Conversation log", "1,,1.0,GPT-4,5,6,11,API log"])
    trace = load_requests(path)
    assert trace.prompt.tolist() == [5, 10] and trace.output.tolist() == [6, 20], "sorted by time, by column name"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("x,ChatGPT,1,2,3,API log", "Timestamp"),
        ("1,ChatGPT,-4,2,3,API log", "Request tokens"),
        ("1,ChatGPT,4,2.5,3,API log", "Response tokens"),
        ("1,ChatGPT", "fields"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path: Path, row: str, reason: str) -> None:
    path = _write(tmp_path, [HEADER, "0,ChatGPT,1,1,2,API log", row])
    with pytest.raises(ValueError, match=rf"b\.csv:3: .*{reason}"):
        read_burstgpt_csv(path)


def test_only_failed_rows_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no requests .*\(1 dropped\)"):
        read_burstgpt_csv(_write(tmp_path, [HEADER, "0,ChatGPT,0,0,0,API log"]))


def test_shipped_excerpt_is_the_source_bytes_and_loads() -> None:
    sums = dict(
        reversed(line.split(maxsplit=1)) for line in (SHIPPED_DATA / "SHA256SUMS").read_text().splitlines() if line
    )
    digest = hashlib.sha256(BURSTGPT.read_bytes()).hexdigest()
    assert sums["requests/burstgpt/BurstGPT_1_first400.csv"] == digest, "byte-identical to the source"
    assert digest == "7865fda5dac50938a84dfccb06c405e2f5202969ecfbd671c8399de00f4335f0", "the fixture's pinned digest"
    lines = BURSTGPT.read_text().splitlines()
    assert lines[0] == HEADER and lines[1:4] == [
        "5,ChatGPT,472,18,490,Conversation log",
        "45,ChatGPT,1087,230,1317,Conversation log",
        "118,GPT-4,417,276,693,Conversation log",
    ]
    trace = load_requests(BURSTGPT)
    assert (len(trace.arrival), trace.dropped) == (383, 17)
    assert trace.duration == 37269.0 and int(np.median(trace.prompt)) == 353


def test_sim_dp_reads_it_and_reports_the_drops(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["sim-dp", "--requests", str(BURSTGPT), "--rate", "4", "--num-requests", "20", "--dispatch", "vllm"]
    result = CliRunner().invoke(app, [*args, "--order", "fcfs", "--json", str(out)])
    assert result.exit_code == 0, result.output
    config = json.loads(out.read_text())["config"]
    assert "17 zero-token rows dropped" in config["workload"]
