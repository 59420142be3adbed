"""What `switchyard report` runs (`ReportOptions`), its sections, rates and the seed's numbers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from switchyard.solver.routing import DECODE_POLICIES

__all__ = ["BRACKET_OVERHEADS_MS", "FULL_RATES", "LOAD_BALANCERS", "QUICK_RATES", "SECTIONS", "SEED", "ReportOptions"]

LOAD_BALANCERS = ("random", "rr", "jsq", "p2c")

SEED = {
    "fig2": "16→128 active experts at batch 64: 4.7× MoE-layer latency; batch size at fixed experts nearly flat "
    "(one MI300X, Qwen3-30B-A3B)",
    "fig4": "same-domain batches activate 17–21 % fewer experts (task), 3–10 % (language), three MoE models",
    "fig11": "ELDR median TPOT −7.0…−13.9 % vs the best of four load balancers at every rate, tail −3.4…−6.0 %; "
    "Domain −6.8…−9.7 % median; TTFT tracks the baselines (Qwen3-30B-A3B, task workload, 8P16D, MI300X)",
    "fig15": "mean Δ vs RR over 20–100 req/s at 8P16D, τ = 0.1: vanilla K-means up to −9.8 % P50 but +17.4 % P99; "
    "balanced −12.6 % P50, −6.8 % P99",
    "fig16": "τ = 0.1 is the optimum; τ = 0 (nearest centroid only) regresses the tail on 4 of 6 workloads; beyond "
    "0.1 the median erodes as requests spill out of their band",
    "table2": "ELDR median TPOT gain grows with the decoder pool: 8.0 % (8P8D) → 9.8 % (8P16D) → 10.2 % (8P24D)",
}


#: Rates (req/s) of the full report's sweep at 8P16D. The seed swept 20–100 req/s on Qwen3-30B-A3B served by
#: vLLM on MI300X; the simulated DeepSeek-V2-Lite fleet (fewer active parameters, datasheet-peak physics,
#: no CPU overhead) is far faster, so 20–100 req/s leaves its decoders with batches of 1–4 where no router
#: matters. This sweep spans light load (batch ≈ 2) to near prefill saturation (batch ≈ 45).
FULL_RATES = (50.0, 100.0, 200.0, 400.0, 800.0)
QUICK_RATES = (200.0, 600.0)

SECTIONS = ("fig2", "fig4", "fig11", "fig15", "fig16", "table2", "bracket", "gimbal")
#: The bracket's sweep: fixed CPU time per step (ms) and EP all-to-all off/on (`CostModel` cost terms).
BRACKET_OVERHEADS_MS = (0.0, 1.0, 2.0, 5.0)


@dataclass(frozen=True)
class ReportOptions:
    """What the report runs; `quick` shrinks every experiment (the test suite runs it in seconds)."""

    trace: Path
    requests: Path
    quick: bool = False
    num_requests: int | None = None
    rates: tuple[float, ...] | None = None
    gpu: str = "MI300X"
    seed: int = 0
    progress: bool = True
    sections: tuple[str, ...] = SECTIONS
    #: The `gimbal` section's runs folder (bench/gimbal_seed.py's `--out`); default docs/results/gimbal_seed.
    gimbal_results: Path | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sections) - set(SECTIONS))
        if unknown or not self.sections:
            raise ValueError(
                f"unknown report section(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SECTIONS)}"
            )

    @property
    def n(self) -> int:
        return self.num_requests or (150 if self.quick else 6000)

    @property
    def sweep(self) -> list[float]:
        return sorted(self.rates or (QUICK_RATES if self.quick else FULL_RATES))

    @property
    def mid_rate(self) -> float:
        """The rate of the τ sweep; Table 2 keeps its per-decoder share (mid / 16) at every pool size."""
        return self.sweep[(len(self.sweep) - 1) // 2]

    @property
    def taus(self) -> list[float]:
        return [0.0, 0.1, 1.0] if self.quick else [0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0]

    @property
    def decoders(self) -> list[int]:
        return [8, 16] if self.quick else [8, 16, 24]

    @property
    def policies(self) -> list[str]:
        return list(DECODE_POLICIES)
