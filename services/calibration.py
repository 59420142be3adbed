"""`switchyard calibrate`: the offline job that fits the greedy placement's (α, β, γ) to MINLP solutions.

It reads recorded expert-load windows, solves each window's MINLP (`solver.placement.minlp`), fits the
greedy's weights to those solutions (`solver.placement.calibrate`) and appends one row to the
`calibrations` table: (α, β, γ), agreement, communication gap, MINLP solve time, and per-window details.

Windows come from files:

- `*.npz` with `expert_counts` B[L, E] or `source_counts` A[L, S, E] (as `ExpertLoad` carries them) and
  optionally `placement` [L, G, slots], the engines' slot map at the time (x⁰);
- `*.msgpack`: one encoded `shared.schemas.ExpertLoad` message, as the placement service receives it;
- a folder of SGLang expert-statistics JSONs (`{"logical_count": [[int] * E] * layers}`, e.g.
  `data/expert_load/sglang_deepseek_v3/`, shipped in `switchyard.data`). These carry B only; to give the
  source-aware terms
  real counts, each file (a workload) plays one source DP rank: files of one phase (decode / prefill),
  sorted by name, are taken `sources_per_window` at a time, each scaled to the same token volume (a
  balanced DP dispatcher), and source s is local to the s-th block of G/S GPUs.

Without a recorded placement, x⁰ is the engines' default layout (expert e on GPU e // (E/G)).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from switchyard.shared.db import Calibration
from switchyard.shared.placement_terms import DEFAULT_OBJECTIVE_TOLERANCE
from switchyard.solver.placement import MinlpOptions, PlacementProblem, Weights, contiguous_slots, locality_distance
from switchyard.solver.placement.calibrate import CalibrationResult, calibrate


class WindowError(ValueError):
    """A window file that cannot be read as expert-load counts."""


@dataclass(frozen=True)
class Window:
    """Raw counts of one recorded window: A[L, S, E] (S = 1 when only B was recorded), and x⁰ if known."""

    name: str
    source_counts: np.ndarray
    placement: np.ndarray | None = None


def load_sglang_counts(path: Path) -> np.ndarray:
    """B[L, E] of the MoE layers in one SGLang statistics file (leading all-zero dense layers dropped)."""
    try:
        counts = np.asarray(json.loads(Path(path).read_text())["logical_count"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WindowError(f"{path}: not an SGLang expert-statistics JSON ({exc})") from None
    if counts.ndim != 2 or not np.isfinite(counts).all() or (counts < 0).any():
        raise WindowError(f"{path}: logical_count must be a non-negative [layers, experts] matrix")
    moe = np.flatnonzero(counts.sum(axis=1) > 0)
    if not len(moe):
        raise WindowError(f"{path}: every layer is empty")
    return counts[moe[0] :]


def sglang_windows(data_dir: Path, sources_per_window: int = 4) -> list[Window]:
    """Windows built from a folder of SGLang JSONs: per phase, `sources_per_window` workloads as sources."""
    files = sorted(Path(data_dir).glob("*.json"))
    if not files:
        raise WindowError(f"{data_dir}: no *.json expert statistics")
    windows = []
    for phase in sorted({f.name.split("_")[0] for f in files}):
        group = [f for f in files if f.name.split("_")[0] == phase]
        for start in range(0, len(group) - sources_per_window + 1, sources_per_window):
            chunk = group[start : start + sources_per_window]
            counts = np.stack([load_sglang_counts(f) for f in chunk], axis=1)
            volume = counts.sum(axis=2, keepdims=True)
            equal = counts / np.where(volume > 0, volume, 1.0) * volume.mean(axis=1, keepdims=True)
            windows.append(Window(name=f"{phase}:" + ",".join(f.stem for f in chunk), source_counts=equal))
    if not windows:
        raise WindowError(f"{data_dir}: fewer than {sources_per_window} files of any phase")
    return windows


def load_window(path: Path) -> Window:
    """One recorded window from an `.npz` or `.msgpack` file (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        raise WindowError(f"{path} is a folder: only folders of SGLang JSONs are read as windows")
    try:
        if path.suffix == ".npz":
            return _load_npz(path)
        if path.suffix == ".msgpack":
            from switchyard.shared.codec import decode
            from switchyard.shared.schemas import ExpertLoad

            load = decode(path.read_bytes(), ExpertLoad)
            counts = load.source_counts if load.source_counts is not None else load.expert_counts[:, None, :]
            return Window(name=f"{load.engine_id}:{load.seq}", source_counts=np.asarray(counts, dtype=np.float64))
    except (OSError, ValueError, IndexError) as exc:  # unreadable, malformed, or a WireError naming the field
        raise WindowError(f"{path}: {exc}") from None
    raise WindowError(f"{path}: unknown window format (expected .npz or .msgpack)")


def _load_npz(path: Path) -> Window:
    with np.load(path, allow_pickle=False) as data:
        if "source_counts" in data:
            counts = data["source_counts"]
        elif "expert_counts" in data:
            counts = data["expert_counts"][:, None, :]
        else:
            raise WindowError(f"{path}: needs source_counts [L, S, E] or expert_counts [L, E]")
        placement = data.get("placement", None)
    if counts.ndim != 3:
        raise WindowError(f"{path}: counts must be [L, E] or [L, S, E], got shape {list(counts.shape)}")
    return Window(name=path.stem, source_counts=np.asarray(counts, dtype=np.float64), placement=placement)


def window_problem(
    window: Window,
    num_gpus: int,
    *,
    migration_cost: float,
    weights: Weights,
    redundant_slots: int = 0,
    layers: int | None = None,
    experts: int | None = None,
) -> PlacementProblem:
    """The placement problem of one window on `num_gpus` GPUs, optionally cut to its first layers/experts."""
    counts = window.source_counts[:layers, :, :experts]
    num_layers, num_sources, num_experts = counts.shape
    current = window.placement if layers is None and experts is None else None
    slots = -(-(num_experts + redundant_slots) // num_gpus) if current is None else int(np.shape(current)[2])
    if current is None:
        current = contiguous_slots(num_layers, num_experts, num_gpus, slots)
    distance = None
    if num_sources > 1:
        groups = min(num_sources, num_gpus)  # source s is local to the GPUs of its DP group
        distance = locality_distance(
            np.arange(num_sources) * groups // num_sources, np.arange(num_gpus) * groups // num_gpus
        )
    return PlacementProblem.from_counts(
        counts if distance is not None else counts[:, 0, :],
        num_gpus,
        slots,
        distance=distance,
        current=current,
        migration_cost=migration_cost,
        redundant_slots=redundant_slots,
        weights=weights,
    )


def run_calibration(
    windows: Sequence[Window],
    num_gpus: int,
    options: MinlpOptions,
    *,
    migration_cost: float,
    weights: Weights,
    objective_tolerance: float = DEFAULT_OBJECTIVE_TOLERANCE,
    layers: int | None = None,
    experts: int | None = None,
    on_solve: Callable[[int, int], None] | None = None,
) -> CalibrationResult:
    """Build each window's problem and calibrate on all of them together (`on_solve`: `calibrate`'s progress)."""
    problems = [
        window_problem(w, num_gpus, migration_cost=migration_cost, weights=weights, layers=layers, experts=experts)
        for w in windows
    ]
    return calibrate(problems, options, objective_tolerance=objective_tolerance, on_solve=on_solve)


def calibration_row(result: CalibrationResult, *, engine_group: str | None, extra: dict) -> Calibration:
    """The `calibrations` row of a successful calibration (the offline job and the placement service alike)."""
    return Calibration(
        engine_group=engine_group,
        status="succeeded",
        params=result.params.as_map(),
        agreement=result.agreement,
        comm_gap=result.comm_gap,
        solve_seconds=result.minlp_seconds,
        num_windows=result.num_windows,
        details={**result.details(), **extra},
    )


def persist(database_url: str, result: CalibrationResult, *, engine_group: str | None, extra: dict) -> int:
    """Append the calibration to the `calibrations` table (schema brought to head first); returns its id."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from switchyard.shared.db import sync_url, upgrade

    upgrade(database_url)
    engine = create_engine(sync_url(database_url))
    try:
        with Session(engine) as session, session.begin():
            row = calibration_row(result, engine_group=engine_group, extra=extra)
            session.add(row)
            session.flush()
            return row.id
    finally:
        engine.dispose()
