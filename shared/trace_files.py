"""Routing-trace files: Switchyard's npz format and the shipped ESFT selections, read into `RoutingTrace`.

The formats are documented in `docs/routing-trace-format.md`:

- ``npz``: Switchyard's own format (`save_npz` writes it, `load_npz` reads it);
- ``esft``: the DeepSeek-V2-Lite expert selections shipped in `switchyard.data` (`routing/esft_deepseek_v2_lite/`)
  (one teacher-forced pass per sequence; task -> label; no phase, so `split_phases` cuts each sequence).

File I/O is kept out of `solver/` (pure numerics): the fit's and the simulator's callers load the trace
here and hand the solver arrays. Every unreadable file raises `TraceError` naming the file and the problem.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Literal

import numpy as np

from switchyard.shared.routing_trace import RoutingTrace, TraceError, split_phases, split_windows

__all__ = [
    "ESFT_MODEL_NAME",
    "ESFT_NUM_EXPERTS",
    "TraceFormat",
    "detect_format",
    "load_esft",
    "load_npz",
    "load_trace",
    "save_npz",
]

#: DeepSeek-V2-Lite: 64 routed experts per MoE layer (the file does not record it).
ESFT_NUM_EXPERTS = 64
ESFT_MODEL_NAME = "DeepSeek-V2-Lite"
ESFT_FILE = "esft_routing_compact.npz"

TraceFormat = Literal["auto", "npz", "esft"]


def _npz_reason(exc: BaseException) -> str:
    """numpy's reason for refusing a file, minus its advice to unpickle untrusted data."""
    return "not a zip archive of arrays" if "pickled" in str(exc) else str(exc)


def _fail(message: str) -> TraceError:
    return TraceError(message)


def _open_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise _fail(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise _fail(f"{path}: not a readable .npz archive ({_npz_reason(exc)})") from None
    except ValueError as exc:  # object arrays need pickle, which is refused
        raise _fail(f"{path}: {exc}") from None


def _require(data: dict[str, np.ndarray], path: Path, *keys: str) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise _fail(f"{path}: missing array(s) {missing}; present: {sorted(data)}")


def _scalar_int(value: np.ndarray, name: str) -> int:
    if value.shape != () or value.dtype.kind not in "iu":
        raise _fail(f"{name} must be an integer scalar, got dtype {value.dtype} shape {list(value.shape)}")
    return int(value)


def load_npz(path: str | Path) -> RoutingTrace:
    """Read Switchyard's npz trace format (docs/routing-trace-format.md)."""
    path = Path(path)
    data = _open_npz(path)
    _require(data, path, "experts", "request", "num_experts")
    names = data.get("label_names")
    if names is not None and (names.ndim != 1 or names.dtype.kind not in "US"):
        raise _fail(f"{path}: label_names must be a 1-D array of strings")
    model_name = data.get("model_name")
    if model_name is not None and (model_name.shape != () or model_name.dtype.kind not in "US"):
        raise _fail(f"{path}: model_name must be a string scalar")
    try:
        return RoutingTrace.from_arrays(
            experts=data["experts"],
            request=data["request"],
            num_experts=_scalar_int(data["num_experts"], "num_experts"),
            phase=data.get("phase"),
            label=data.get("label"),
            label_names=None if names is None else [str(n) for n in names],
            weights=data.get("weights"),
            model_name=str(model_name) if model_name is not None else "unknown",
        )
    except TraceError as exc:
        raise _fail(f"{path}: {exc}") from None


def save_npz(trace: RoutingTrace, path: str | Path) -> None:
    """Write a trace in Switchyard's npz format (compressed); `load_npz` reads it back identically."""
    arrays: dict[str, Any] = {  # np.savez_compressed types its keyword arrays loosely
        "experts": trace.experts,
        "request": trace.request,
        "num_experts": np.asarray(trace.num_experts, dtype=np.int64),
        "model_name": np.asarray(trace.model_name),
    }
    optional = {"phase": trace.phase, "label": trace.label, "weights": trace.weights}
    arrays.update({k: v for k, v in optional.items() if v is not None})
    if trace.label_names is not None:
        arrays["label_names"] = np.asarray(trace.label_names)
    with Path(path).open("wb") as f:
        np.savez_compressed(f, **arrays)


def _esft_file(path: Path) -> Path:
    return path / ESFT_FILE if path.is_dir() else path


def load_esft(path: str | Path, num_experts: int = ESFT_NUM_EXPERTS) -> RoutingTrace:
    """Read the ESFT DeepSeek-V2-Lite selections (a folder or its npz): sequence -> request, task -> label."""
    file = _esft_file(Path(path))
    data = _open_npz(file)
    _require(data, file, "task_names", "task", "seq", "pos", "experts")
    task, seq, pos = data["task"], data["seq"], data["pos"]
    n = data["experts"].shape[0] if data["experts"].ndim else -1
    for name, arr in (("task", task), ("seq", seq), ("pos", pos)):
        if arr.shape != (n,) or arr.dtype.kind not in "iu":
            raise _fail(f"{file}: {name} must be an integer array with one entry per token ({n})")
    if n <= 0:
        raise _fail(f"{file}: no tokens")
    if task.min() < 0 or seq.min() < 0 or pos.min() < 0:
        raise _fail(f"{file}: task, seq and pos must be non-negative")
    # One request per (task, sequence); tokens in position order within it.
    key = task.astype(np.int64) * (int(seq.max()) + 1) + seq
    order = np.lexsort((pos, key))
    key, pos = key[order], pos[order]
    same = np.diff(key) == 0
    if (np.diff(pos)[same] == 0).any():
        raise _fail(f"{file}: a sequence lists the same token position twice")
    weights = data.get("weights")
    try:
        return RoutingTrace.from_arrays(
            experts=data["experts"][order],
            request=key,
            num_experts=num_experts,
            label=task[order],
            label_names=[str(n) for n in data["task_names"]],
            weights=None if weights is None else weights[order],
            model_name=ESFT_MODEL_NAME,
        )
    except TraceError as exc:
        raise _fail(f"{file}: {exc}") from None


def detect_format(path: str | Path) -> Literal["npz", "esft"]:
    """`esft` for the ESFT folder or an npz with its keys (task, seq, pos), else `npz`."""
    path = Path(path)
    if path.is_dir():
        if (path / ESFT_FILE).is_file():
            return "esft"
        raise _fail(f"{path}: a folder, but it holds no {ESFT_FILE}")
    if not path.is_file():
        raise _fail(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = set(data.files)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise _fail(f"{path}: not a readable .npz archive ({_npz_reason(exc)})") from None
    return "esft" if {"task", "seq", "pos"} <= keys and "request" not in keys else "npz"


def load_trace(
    path: str | Path,
    fmt: TraceFormat = "auto",
    prefill_fraction: float = 0.5,
    window: int | None = None,
) -> RoutingTrace:
    """Load a trace ready for fitting: optionally cut into windows, and phases split where none are recorded.

    A trace that records `phase` keeps it (`prefill_fraction` is then unused); `window` needs one that does not.
    """
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "esft":
        trace = load_esft(path)
    elif fmt == "npz":
        trace = load_npz(path)
    else:
        raise _fail(f"unknown trace format {fmt!r} (expected npz or esft)")
    if window is not None:
        trace = split_windows(trace, window)
    if trace.phase is None:
        trace = split_phases(trace, prefill_fraction)
    return trace
