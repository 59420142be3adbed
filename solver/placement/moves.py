"""From the engines' slot map to a plan's: an ordered list of expert moves that is safe to execute one by one.

A move is a row of `shared.schemas.MOVE_COLUMNS` = (layer, expert, src_gpu, src_slot, dst_gpu, dst_slot):

- all four ≥ 0: copy the expert's weights from the source slot into the destination slot, then free the
  source slot;
- src = (-1, -1): copy the expert in as a new replica, from any live copy, into the destination slot;
- dst = (-1, -1): free the source slot (drop one replica).

Executed in order, the moves keep two invariants at every step, so an engine can keep serving while it
migrates: a destination slot is empty when written (nothing is overwritten before it has been copied
away), and every expert keeps at least one live copy (a replica is dropped only while another exists).
A layer whose moves form a cycle (experts swapping GPUs in a full layer) needs one temporary slot: a free
slot of the layer if there is one (on the blocking expert's own GPU if possible, so the extra hop is a
local copy), else the per-GPU scratch slot `slots_per_gpu` when `buffer=True` (engines that reserve one
expert buffer per GPU, as vLLM's EPLB rearrangement does). Without either, `plan_moves` raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.solver.placement.problem import PlacementError, hosts_from_slots

NO_SLOT = (-1, -1)


class MoveError(PlacementError):
    """A move list that cannot be planned or applied without breaking an invariant."""


@dataclass
class _Op:
    expert: int
    src: tuple[int, int]
    dst: tuple[int, int]


def plan_moves(current: np.ndarray, target: np.ndarray, *, buffer: bool = False) -> np.ndarray:
    """Moves [n, 6] (int64, `MOVE_COLUMNS`) that turn slot map `current` into `target`, layer by layer."""
    current, target = _check_pair(current, target)
    rows: list[list[int]] = []
    for layer in range(current.shape[0]):
        for op in _plan_layer(current[layer], target[layer], buffer):
            rows.append([layer, op.expert, *op.src, *op.dst])
    return np.array(rows, dtype=np.int64).reshape(-1, 6)


def apply_moves(current: np.ndarray, moves: np.ndarray, *, buffer: bool = False) -> np.ndarray:
    """The slot map after executing `moves` in order; raises `MoveError` at the first unsafe move."""
    state = _with_buffer(np.array(current, dtype=np.int64), buffer)
    moves = np.asarray(moves, dtype=np.int64).reshape(-1, 6)
    for index, (layer, expert, src_gpu, src_slot, dst_gpu, dst_slot) in enumerate(moves.tolist()):
        where = f"move {index} (layer {layer}, expert {expert})"
        if not 0 <= layer < state.shape[0]:
            raise MoveError(f"{where}: no such layer")
        slots = state[layer]
        if (src_gpu, src_slot) != NO_SLOT:
            if _get(slots, src_gpu, src_slot) != expert:
                raise MoveError(f"{where}: source slot ({src_gpu}, {src_slot}) does not hold it")
            if (dst_gpu, dst_slot) == NO_SLOT and (slots == expert).sum() < 2:
                raise MoveError(f"{where}: dropping its last copy")
        elif (slots == expert).sum() == 0:
            raise MoveError(f"{where}: new replica of an expert with no live copy")
        if (dst_gpu, dst_slot) != NO_SLOT:
            if _get(slots, dst_gpu, dst_slot) != -1:
                raise MoveError(f"{where}: destination slot ({dst_gpu}, {dst_slot}) is not empty")
            slots[dst_gpu, dst_slot] = expert
        if (src_gpu, src_slot) != NO_SLOT:
            slots[src_gpu, src_slot] = -1
    if buffer:
        if (state[:, :, -1] != -1).any():
            raise MoveError("the moves leave an expert in a scratch slot")
        state = state[:, :, :-1]
    return state


def _check_pair(current: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    current, target = np.asarray(current), np.asarray(target)
    if current.shape != target.shape or current.ndim != 3:
        raise MoveError(f"slot maps differ in shape: {list(current.shape)} vs {list(target.shape)}")
    num_experts = int(max(current.max(initial=-1), target.max(initial=-1))) + 1
    have, want = hosts_from_slots(current, num_experts), hosts_from_slots(target, num_experts)
    if (have.sum(axis=2) == 0).any() or (want.sum(axis=2) == 0).any():
        raise MoveError("every expert of a layer must have a slot in both placements")
    if (have > 1).any() or (want > 1).any():
        raise MoveError("an expert occupies two slots of one GPU")
    return current.astype(np.int64), target.astype(np.int64)


def _with_buffer(slot_map: np.ndarray, buffer: bool) -> np.ndarray:
    if not buffer:
        return slot_map
    scratch = np.full((*slot_map.shape[:2], 1), -1, dtype=np.int64)
    return np.concatenate([slot_map, scratch], axis=2)


def _get(slots: np.ndarray, gpu: int, slot: int) -> int:
    if not (0 <= gpu < slots.shape[0] and 0 <= slot < slots.shape[1]):
        raise MoveError(f"slot ({gpu}, {slot}) does not exist")
    return int(slots[gpu, slot])


def _plan_layer(current: np.ndarray, target: np.ndarray, buffer: bool) -> list[_Op]:
    """Pair each expert's departures with its arrivals, then emit ops in a safe order (see module doc)."""
    occupied = _with_buffer(current[None].copy(), buffer)[0]
    changed = current != target
    drops, moves, adds = [], [], []
    for expert in np.unique(np.concatenate([current[changed], target[changed]])):
        if expert < 0:
            continue
        leaving = [(int(g), int(s)) for g, s in np.argwhere(changed & (current == expert))]
        arriving = [(int(g), int(s)) for g, s in np.argwhere(changed & (target == expert))]
        pairs = _pair_by_gpu(leaving, arriving)
        moves += [_Op(int(expert), src, dst) for src, dst in pairs]
        drops += [_Op(int(expert), src, NO_SLOT) for src in leaving]
        adds += [_Op(int(expert), NO_SLOT, dst) for dst in arriving]

    done: list[_Op] = []
    pending = drops + moves + adds  # drops free slots at once; moves free their source; adds free nothing
    while pending:
        waiting = []
        for op in pending:
            if _ready(op, occupied):
                _execute(op, occupied)
                done.append(op)
            else:
                waiting.append(op)
        if len(waiting) == len(pending):  # only cycles of moves remain: park one blocker in a free slot
            blocked = next(op for op in waiting if op.src != NO_SLOT)
            blocker = next(op for op in waiting if op.src == blocked.dst)
            parked = _Op(blocker.expert, blocker.src, _temporary_slot(occupied, blocker.src[0], current.shape[1]))
            _execute(parked, occupied)
            done.append(parked)
            blocker.src = parked.dst
        pending = waiting
    return done


def _pair_by_gpu(leaving: list[tuple[int, int]], arriving: list[tuple[int, int]]) -> list[tuple]:
    """Pair sources with destinations, same-GPU pairs first (a local copy); removes the paired ones."""
    pairs = []
    for src in list(leaving):
        dst = next((d for d in arriving if d[0] == src[0]), None)
        if dst is not None:
            pairs.append((src, dst))
            leaving.remove(src)
            arriving.remove(dst)
    count = min(len(leaving), len(arriving))
    pairs += list(zip(leaving[:count], arriving[:count], strict=True))
    del leaving[:count], arriving[:count]
    return pairs


def _ready(op: _Op, occupied: np.ndarray) -> bool:
    if op.dst == NO_SLOT:
        return (occupied == op.expert).sum() >= 2
    return occupied[op.dst] == -1


def _execute(op: _Op, occupied: np.ndarray) -> None:
    if op.dst != NO_SLOT:
        occupied[op.dst] = op.expert
    if op.src != NO_SLOT:
        occupied[op.src] = -1


def _temporary_slot(occupied: np.ndarray, gpu: int, slots_per_gpu: int) -> tuple[int, int]:
    """A free slot of the layer, on `gpu` if possible; else a free scratch slot; else `MoveError`."""
    free = np.argwhere(occupied[:, :slots_per_gpu] == -1)
    if len(free):
        local = free[free[:, 0] == gpu]
        gpu_, slot = local[0] if len(local) else free[0]
        return int(gpu_), int(slot)
    if occupied.shape[1] > slots_per_gpu:
        scratch = np.flatnonzero(occupied[:, slots_per_gpu] == -1)
        if len(scratch):
            return (gpu if gpu in scratch else int(scratch[0])), slots_per_gpu
    raise MoveError("moves form a cycle in a full layer: leave a slot free or plan with buffer=True")
