"""Fixed-seed simulator figures, recorded so that refactors can prove they change no behaviour.

`python -m tests.sim_fingerprint` rewrites `tests/golden/sim_fixed_seed.json`; do that only when a change of
figures is intended and explained in the commit message. `tests/test_sim_golden.py` compares against it.
The runs are small (seconds) but cover every decode policy, both prefill rules, the cost terms of the
bracket, every DP dispatch rule in both queue orders, coupled and independent DP fleets.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from switchyard.simulator.offline.dp_run import DPSimOptions, run_sim_dp
from switchyard.simulator.offline.metrics import summarize
from switchyard.simulator.offline.run import SimOptions, run_sim
from switchyard.simulator.offline.scenario import prepare
from tests.conftest import SHIPPED_DATA

GOLDEN = Path(__file__).parent / "golden" / "sim_fixed_seed.json"
ESFT = SHIPPED_DATA / "routing" / "esft_deepseek_v2_lite"
CODE_CSV = SHIPPED_DATA / "requests" / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
DECODE_POLICIES = ("random", "rr", "jsq", "p2c", "domain", "eldr", "eldr-vanilla", "eldr-tau0")
VOLATILE = {"wall_s", "trace", "requests"}


def _clean(obj: object) -> object:
    """Drop wall-clock and path fields; round floats to 12 significant digits (platform-stable)."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, float):
        return float(f"{obj:.12g}")
    return obj


def fingerprint() -> dict[str, object]:
    out: dict[str, object] = {}
    base = SimOptions(trace=ESFT, rate=40.0, prefill=2, decode=6, num_requests=400, progress=False)
    out["xpyd_rr_prefill"] = run_sim(replace(base, policies=DECODE_POLICIES))
    out["xpyd_hash_prefill"] = run_sim(replace(base, policies=("jsq", "eldr"), prefill_policy="hash", seed=3))
    sc = prepare(ESFT, seed=1)
    fleet = sc.fleet(2, 6)
    fleet = replace(fleet, cost=replace(sc.cost, step_overhead_s=2e-3, a2a=True))
    wl = sc.workload(300, seed=1, rate=40.0, max_tokens=fleet.decode_kv_blocks * sc.cost.block_size)
    out["xpyd_cost_terms"] = {p: summarize(sc.run(wl, fleet, p, seed=1)) for p in ("jsq", "eldr")}
    dp = DPSimOptions(trace=ESFT, requests=CODE_CSV, time_scale=40.0, num_requests=200)
    out["dp_coupled"] = run_sim_dp(replace(dp, dispatch=("rr", "jsq", "vllm", "vllm-main", "gimbal")))
    out["dp_independent"] = run_sim_dp(
        replace(dp, requests=None, rate=8.0, engines=4, coupled=False, dispatch=("jsq", "vllm", "gimbal"))
    )
    out["dp_kv_bound"] = run_sim_dp(
        replace(dp, kv_blocks=400, max_running=64, num_requests=150, dispatch=("vllm", "gimbal"), orders=("fcfs",))
    )
    return _clean(out)  # type: ignore[return-value]


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(fingerprint(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
