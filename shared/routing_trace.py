"""Routing traces: which experts every token selected at every MoE layer, grouped into requests.

A `RoutingTrace` is the input of the ELDR offline fit (`solver.eldr_fit`) and of the simulator, a contract
between whoever records routing and whoever fits or replays it, so it lives in `shared/` beside the wire
schemas; reading and writing its files is `shared.trace_files` (docs/routing-trace-format.md). Its arrays
are canonical: tokens are grouped by request (request ids dense ``0..R-1``, non-decreasing), and within a
request they are in processing order, prefill before decode. Traces recorded without a phase (ESFT is one
teacher-forced pass per sequence) get one from `split_phases`.

Every malformed input raises `TraceError` naming the array and the problem; nothing is silently repaired.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "PHASE_DECODE",
    "PHASE_PREFILL",
    "RoutingTrace",
    "TraceError",
    "split_phases",
    "split_windows",
]

PHASE_PREFILL = 0
PHASE_DECODE = 1


class TraceError(ValueError):
    """A routing trace that cannot be used: missing or ill-shaped array, out-of-range id, bad option."""


def _fail(message: str) -> TraceError:
    return TraceError(message)


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """Token-level expert selections in canonical order (see the module docstring).

    experts[N, L, k]: expert id chosen by token n at MoE layer l (k distinct ids per row).
    request[N]: dense request index, non-decreasing.
    phase[N]: 0 prefill, 1 decode (None: not yet split, see `split_phases`).
    label[N] / label_names: optional domain label per token, constant within a request.
    weights[N, L, k]: optional gate probability of each selected expert.
    """

    experts: np.ndarray
    request: np.ndarray
    num_experts: int
    phase: np.ndarray | None = None
    label: np.ndarray | None = None
    label_names: tuple[str, ...] | None = None
    weights: np.ndarray | None = None
    model_name: str = "unknown"

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_arrays(
        cls,
        experts: np.ndarray,
        request: np.ndarray,
        num_experts: int,
        phase: np.ndarray | None = None,
        label: np.ndarray | None = None,
        label_names: tuple[str, ...] | list[str] | None = None,
        weights: np.ndarray | None = None,
        model_name: str = "unknown",
    ) -> RoutingTrace:
        """Canonicalise arbitrary request ids: remap them to 0..R-1 (ascending) and group tokens by request.

        Tokens of one request keep their relative order (a stable sort), so interleaved requests are fine.
        """
        experts, request = np.asarray(experts), np.asarray(request)
        if request.ndim != 1 or request.dtype.kind not in "iu":
            raise _fail(f"request must be a 1-D integer array, got dtype {request.dtype} shape {list(request.shape)}")
        if experts.ndim < 1 or experts.shape[0] != request.shape[0]:
            raise _fail(f"experts has {experts.shape[:1]} tokens but request has {request.shape[0]}")
        if request.size and request.min() < 0:
            raise _fail("request ids must be non-negative")
        _, dense = np.unique(request, return_inverse=True)
        order = np.argsort(dense, kind="stable")
        identity = bool((order == np.arange(order.size)).all())

        def take(a: np.ndarray | None) -> np.ndarray | None:
            if a is None:
                return None
            a = np.asarray(a)
            if a.ndim < 1 or a.shape[0] != request.shape[0]:
                raise _fail(f"an array has {a.shape[:1]} rows, expected {request.shape[0]} (one per token)")
            return a if identity else a[order]

        return cls(
            experts=take(experts),  # type: ignore[arg-type]
            request=dense[order].astype(np.int64),
            num_experts=num_experts,
            phase=take(phase),
            label=take(label),
            label_names=tuple(str(n) for n in label_names) if label_names is not None else None,
            weights=take(weights),
            model_name=model_name,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def num_requests(self) -> int:
        return int(self.request[-1]) + 1

    def request_lengths(self) -> np.ndarray:
        """Tokens per request, [R]."""
        return np.bincount(self.request, minlength=self.num_requests)

    def request_starts(self) -> np.ndarray:
        """Index of each request's first token, [R]."""
        return np.concatenate(([0], np.cumsum(self.request_lengths())[:-1]))

    def positions(self) -> np.ndarray:
        """Position of every token within its request, [N]."""
        return np.arange(self.num_tokens) - self.request_starts()[self.request]

    def request_labels(self) -> np.ndarray | None:
        """One label per request, [R] (labels are constant within a request)."""
        return None if self.label is None else self.label[self.request_starts()]


def _validate(t: RoutingTrace) -> None:
    """Check every invariant the numerics rely on; raise `TraceError` with the first violation."""
    experts, request = t.experts, t.request
    if not isinstance(experts, np.ndarray) or experts.ndim != 3:
        raise _fail(f"experts must be a 3-D array [tokens, layers, top_k], got shape {np.shape(experts)}")
    if experts.dtype.kind not in "iu":
        raise _fail(f"experts must hold integer expert ids, got dtype {experts.dtype}")
    n, layers, k = experts.shape
    if n == 0 or layers == 0 or k == 0:
        raise _fail(f"experts is empty: shape {list(experts.shape)}")
    if isinstance(t.num_experts, bool) or not isinstance(t.num_experts, int | np.integer) or t.num_experts < 1:
        raise _fail(f"num_experts must be a positive integer, got {t.num_experts!r}")
    if k > t.num_experts:
        raise _fail(f"top_k {k} exceeds num_experts {t.num_experts}")
    lo, hi = int(experts.min()), int(experts.max())
    if lo < 0 or hi >= t.num_experts:
        raise _fail(f"expert ids must lie in [0, {t.num_experts}), found range [{lo}, {hi}]")
    if k > 1:
        ordered = np.sort(experts, axis=2)
        dup = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
        if dup.any():
            token, layer = np.argwhere(dup)[0]
            raise _fail(f"token {token} selects the same expert twice at layer {layer}: top-k ids must be distinct")

    if not isinstance(request, np.ndarray) or request.shape != (n,) or request.dtype.kind not in "iu":
        raise _fail(f"request must be an integer array of shape [{n}], got {np.shape(request)}")
    steps = np.diff(request)
    if request[0] != 0 or (steps < 0).any() or (steps > 1).any():
        raise _fail("request ids must be dense 0..R-1 and grouped (use RoutingTrace.from_arrays to canonicalise)")

    if t.phase is not None:
        phase = t.phase
        if not isinstance(phase, np.ndarray) or phase.shape != (n,) or phase.dtype.kind not in "biu":
            raise _fail(f"phase must be an integer array of shape [{n}]")
        if ((phase != PHASE_PREFILL) & (phase != PHASE_DECODE)).any():
            raise _fail("phase values must be 0 (prefill) or 1 (decode)")
        same = steps == 0
        if (np.diff(phase.astype(np.int8))[same] < 0).any():
            raise _fail("phase goes from decode back to prefill within a request: prefill tokens must come first")

    if t.label is not None:
        label = t.label
        if not isinstance(label, np.ndarray) or label.shape != (n,) or label.dtype.kind not in "iu":
            raise _fail(f"label must be an integer array of shape [{n}]")
        if label.min() < 0:
            raise _fail("labels must be non-negative")
        if (np.diff(label.astype(np.int64))[steps == 0] != 0).any():
            raise _fail("label changes within a request: a request has one label")
        if t.label_names is not None and label.max() >= len(t.label_names):
            raise _fail(f"label {int(label.max())} has no name ({len(t.label_names)} label_names)")
    elif t.label_names is not None:
        raise _fail("label_names given without label")

    if t.weights is not None:
        w = t.weights
        if not isinstance(w, np.ndarray) or w.shape != experts.shape or w.dtype.kind != "f":
            raise _fail(f"weights must be a float array of the same shape as experts {list(experts.shape)}")
        if not np.isfinite(w).all() or (w < 0).any():
            raise _fail("weights must be finite and non-negative gate probabilities")


def split_phases(trace: RoutingTrace, prefill_fraction: float) -> RoutingTrace:
    """Mark the first ⌊n·f⌋ tokens of each n-token request as prefill, the rest as decode.

    Traces recorded without a phase (ESFT is one teacher-forced pass) need a boundary; every request of
    two or more tokens keeps at least one token on each side, a one-token request is all prefill.
    """
    if not 0.0 < prefill_fraction < 1.0:
        raise _fail(f"prefill fraction must lie strictly between 0 and 1, got {prefill_fraction}")
    lengths = trace.request_lengths()
    cut = np.clip(np.floor(lengths * prefill_fraction).astype(np.int64), 1, np.maximum(lengths - 1, 1))
    phase = (trace.positions() >= cut[trace.request]).astype(np.uint8)
    return replace(trace, phase=phase)


def split_windows(trace: RoutingTrace, window: int) -> RoutingTrace:
    """Cut each request into ⌊n/window⌋ (at least one) consecutive, equal-sized windows, each a request.

    More calibration requests from few long sequences (ESFT has 213); windows of one sequence share its
    label and content, so their pairs are easier than pairs of independent prompts (see the docs).
    """
    if window < 2:
        raise _fail(f"window must be at least 2 tokens, got {window}")
    if trace.phase is not None:
        raise _fail("cannot window a trace with recorded phases; window before splitting phases")
    lengths = trace.request_lengths()
    pieces = np.maximum(lengths // window, 1)
    piece = trace.positions() * pieces[trace.request] // lengths[trace.request]
    first_piece = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    return replace(trace, request=(first_piece[trace.request] + piece).astype(np.int64))
