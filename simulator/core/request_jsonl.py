"""The common JSONL request-trace shape (Mooncake's FAST'25 traces and others), read into plain columns.

Why: prefix-aware traces ship as JSONL, one object per line: ``timestamp`` (ms), ``input_length``,
``output_length`` and optionally ``hash_ids`` (one id per block of the trace's block size, 512 tokens for
Mooncake; equal ids at equal positions mean a shared prefix). Blank lines are skipped; anything else that is
not such an object fails with the file, the line number and the reason (`ValueError`), so the CLI can print
one line. `workload.load_requests` turns the columns into a `RequestTrace`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["MOONCAKE_BLOCK_TOKENS", "JsonlColumns", "read_request_jsonl"]

#: Mooncake's hash-id block: 512 tokens (FAST25-release/README.md).
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class JsonlColumns:
    """A JSONL trace in file order: times (ms), lengths, hash ids per line (None when no line has any)."""

    timestamp_ms: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    hash_ids: tuple[np.ndarray, ...] | None


def _count(obj: dict, name: str, where: str, minimum: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < minimum:
        raise ValueError(f"{where}: {name!r} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _hash_ids(obj: dict, where: str) -> np.ndarray | None:
    ids = obj.get("hash_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
    return np.asarray(ids, dtype=np.int64)


def read_request_jsonl(path: str | Path) -> JsonlColumns:
    """Parse a JSONL request trace; `ValueError` naming the line on the first malformed one."""
    path = Path(path)
    ts: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    hashes: list[np.ndarray | None] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            t = obj.get("timestamp")
            if isinstance(t, bool) or not isinstance(t, int | float) or not np.isfinite(t) or t < 0:
                raise ValueError(f"{where}: 'timestamp' must be a non-negative number of ms, got {t!r}")
            ts.append(float(t))
            prompt.append(_count(obj, "input_length", where, 1))
            output.append(_count(obj, "output_length", where, 0))
            hashes.append(_hash_ids(obj, where))
    if not ts:
        raise ValueError(f"{path}: no requests")
    empty = np.zeros(0, dtype=np.int64)
    any_ids = any(h is not None for h in hashes)
    return JsonlColumns(
        timestamp_ms=np.asarray(ts),
        prompt=np.asarray(prompt, dtype=np.int64),
        output=np.asarray(output, dtype=np.int64),
        hash_ids=tuple(empty if h is None else h for h in hashes) if any_ids else None,
    )
