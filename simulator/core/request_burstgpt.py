"""BurstGPT request traces (`BurstGPT_1.csv` … `_3`, with or without fails), read into plain columns.

Why its own reader: BurstGPT's CSV names its columns (``Timestamp, Model, Request tokens, Response tokens,
Total tokens, Log Type``; ``BurstGPT_3`` inserts ``Session ID`` and ``Elapsed time`` after ``Timestamp``), its
timestamps are seconds rather than Azure's datetimes, and it records failed requests as rows with zero
response tokens (upstream README). Those rows, and any with zero request tokens, cannot be replayed: they are
dropped and counted (`BurstColumns.dropped`) so a caller can say how many. Columns are found by name, never
by position. A malformed row fails with the file, the line and the reason (`ValueError`), so the CLI prints
one line.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["BURSTGPT_COLUMNS", "BurstColumns", "is_burstgpt_header", "read_burstgpt_csv"]

#: The columns every BurstGPT release has (https://github.com/HPMLL/BurstGPT, README "Schema").
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


@dataclass(frozen=True)
class BurstColumns:
    """The replayable rows in file order: arrival (s), prompt and output tokens; `dropped`: zero-token rows."""

    timestamp_s: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    dropped: int
    rows: int


def is_burstgpt_header(header: list[str]) -> bool:
    """True when a CSV header names BurstGPT's columns."""
    names = {h.strip() for h in header}
    return all(c in names for c in BURSTGPT_COLUMNS)


def _int(value: str, name: str, where: str) -> int:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{where}: {name!r} must be a number of tokens, got {value!r}") from None
    if not np.isfinite(number) or number < 0 or number != int(number):
        raise ValueError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return int(number)


def read_burstgpt_csv(path: str | Path) -> BurstColumns:
    """Parse a BurstGPT CSV; zero-token rows dropped and counted; `ValueError` naming the first bad line."""
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        if not is_burstgpt_header(header):
            raise ValueError(f"{path}: not a BurstGPT CSV (needs columns {', '.join(BURSTGPT_COLUMNS)})")
        col = {name: header.index(name) for name in BURSTGPT_COLUMNS}
        ts: list[float] = []
        prompt: list[int] = []
        output: list[int] = []
        rows = dropped = 0
        for number, row in enumerate(reader, start=2):
            if not row or not any(cell.strip() for cell in row):
                continue
            where = f"{path}:{number}"
            if len(row) < len(header):
                raise ValueError(f"{where}: {len(row)} fields, the header has {len(header)}")
            try:
                t = float(row[col["Timestamp"]])
            except ValueError:
                t = float("nan")
            if not np.isfinite(t) or t < 0:
                raise ValueError(f"{where}: 'Timestamp' must be non-negative seconds, got {row[col['Timestamp']]!r}")
            p = _int(row[col["Request tokens"]], "Request tokens", where)
            o = _int(row[col["Response tokens"]], "Response tokens", where)
            rows += 1
            if p == 0 or o == 0:
                dropped += 1
                continue
            ts.append(t)
            prompt.append(p)
            output.append(o)
    if not ts:
        raise ValueError(f"{path}: no requests with non-zero request and response tokens ({dropped} dropped)")
    return BurstColumns(
        timestamp_s=np.asarray(ts),
        prompt=np.asarray(prompt, dtype=np.int64),
        output=np.asarray(output, dtype=np.int64),
        dropped=dropped,
        rows=rows,
    )
