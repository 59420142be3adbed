"""Calibration sets for the ELDR benchmarks: the real ESFT trace, and a synthetic 48 × 128 set built from it.

No public trace has the budget's shape (1,000 requests, 48 layers × 128 experts). `synthetic_counts` builds
one for *timing* only, by resampling ESFT's real per-request counts: synthetic request r takes an ESFT
request a and another request b of the same task; its layer l, experts 0-63, are a's counts at ESFT layer
l mod 26, and experts 64-127 are b's counts at layer (l + 13) mod 26, for prefill and decode alike. So the
sparsity, skew and domain structure are ESFT's, tiled; the figures it yields are labelled synthetic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from switchyard.shared.trace_files import load_trace
from switchyard.solver.signatures import RequestCounts, request_counts

REPO = Path(__file__).resolve().parent.parent
ESFT_DIR = REPO.parent / "shared" / "data" / "routing" / "esft_deepseek_v2_lite"


def esft_counts(prefill_fraction: float = 0.5, window: int | None = None) -> RequestCounts:
    """The real ESFT calibration set (213 sequences, or more with windows)."""
    return request_counts(load_trace(ESFT_DIR, prefill_fraction=prefill_fraction, window=window))


def synthetic_counts(num_requests: int = 1000, layers: int = 48, seed: int = 0) -> RequestCounts:
    """SYNTHETIC [num_requests, layers, 128] counts resampled from ESFT (see the module docstring)."""
    real = esft_counts()
    rng = np.random.default_rng(seed)
    labels = real.label
    a = rng.integers(real.num_requests, size=num_requests)
    # b: a random request with a's label (argsort of random keys within each label group)
    by_label = [np.flatnonzero(labels == t) for t in range(labels.max() + 1)]
    b = np.array([rng.choice(by_label[labels[i]]) for i in a])
    src = np.arange(layers) % real.num_layers
    shifted = (np.arange(layers) + real.num_layers // 2) % real.num_layers

    def tile(c: np.ndarray) -> np.ndarray:
        return np.concatenate([c[a][:, src, :], c[b][:, shifted, :]], axis=2)

    return RequestCounts(
        prefill=tile(real.prefill),
        decode=tile(real.decode),
        top_k=2 * real.top_k,
        prefill_gate=tile(real.prefill_gate) if real.prefill_gate is not None else None,
        label=labels[a],
        label_names=real.label_names,
        model_name="synthetic-48x128-from-ESFT",
    )
