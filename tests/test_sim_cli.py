"""`switchyard sim` and `switchyard report` honour their contracts (small runs on the real traces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from switchyard.cli import app
from tests.conftest import SHIPPED_DATA
from tests.eldr_helpers import ESFT_DIR

AZURE_CONV = SHIPPED_DATA / "requests" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
CONTRACT = ("tpot_p50", "tpot_p99", "ttft_p50", "throughput", "mean_distinct_experts")


def _sim(tmp_path: Path, *extra: str) -> tuple[int, str, dict]:
    out = tmp_path / "sim.json"
    args = ["sim", "--trace", str(ESFT_DIR), "--format", "esft", "--prefill", "2", "--decode", "4"]
    args += ["--num-requests", "80", "--seed", "1", "--json", str(out), "--no-progress", *extra]
    result = CliRunner().invoke(app, args)
    payload = json.loads(out.read_text()) if out.exists() else {}
    return result.exit_code, result.output, payload


def test_sim_writes_the_contract_json_per_policy(tmp_path: Path) -> None:
    code, output, payload = _sim(
        tmp_path,
        "--requests",
        str(AZURE_CONV),
        "--time-scale",
        "20",
        "--policies",
        "rr,jsq,domain",
        "--out",
        str(tmp_path / "out"),
    )
    assert code == 0, output
    assert set(payload["policies"]) == {"rr", "jsq", "domain"}
    header = next(line for line in output.splitlines() if line.startswith("policy"))
    assert "TPOT p50 ms" in header and "tok/s" in header  # the table names its units
    jsq = next(line for line in output.splitlines() if line.startswith("jsq ")).split()
    assert float(jsq[1]) == round(payload["policies"]["jsq"]["tpot_p50"] * 1e3, 2)  # ms, two decimals
    for summary in payload["policies"].values():
        for key in CONTRACT:
            assert isinstance(summary[key], float) and summary[key] > 0, key
    assert payload["config"]["model"] == "deepseek-v2-lite" and payload["config"]["fleet"] == "2P4D"
    assert payload["config"]["calibration_requests"] + payload["config"]["replay_requests"] == 213
    for name in ("summary.csv", "latency_cdf.png", "engine_load.png", "distinct_experts.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name


def test_sim_with_poisson_rate_and_gpu(tmp_path: Path) -> None:
    code, output, payload = _sim(tmp_path, "--rate", "50", "--policies", "p2c", "--gpu", "H200")
    assert code == 0, output
    assert payload["config"]["gpu"] == "H200" and payload["config"]["offered_rate"] > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--policies", "rr"), "either"),  # neither --rate nor --requests
        (("--rate", "5", "--policies", "nope"), "unknown decode policy"),
        (("--rate", "5", "--policies", "rr", "--model", "qwen3-30b-a3b"), "physics would not match"),
    ],
)
def test_sim_rejects_bad_options(tmp_path: Path, extra: tuple[str, ...], message: str) -> None:
    code, output, _ = _sim(tmp_path, *extra)
    assert code != 0 and message in output


def test_report_quick_regenerates_every_experiment(tmp_path: Path) -> None:
    from switchyard.simulator.offline.report import ReportOptions, build_report

    opts = ReportOptions(trace=ESFT_DIR, requests=AZURE_CONV, quick=True, num_requests=80, progress=False)
    md = build_report(tmp_path, opts).read_text()
    for section in ("Fig. 2", "Fig. 4", "Fig. 11", "Fig. 15", "Fig. 16", "Table 2", "Bracket"):
        assert f"## {section}" in md, section
    assert "## Gimbal seed" in md
    assert md.count("Seed: ") == 7, "every experiment prints the seed's numbers beside ours"
    for png in ("fig2_moe_time", "fig4_same_vs_mixed", "fig11_rate_sweep", "fig15_balance", "fig16_tau"):
        assert (tmp_path / f"{png}.png").stat().st_size > 1000, png
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["fig2"]["time_us"][1][2] * 4.7 == pytest.approx(results["fig2"]["time_us"][4][2], rel=1e-3)
    assert {r["fleet"] for r in results["table2"]} == {"8P8D", "8P16D"}
    rows = (tmp_path / "runs.csv").read_text().splitlines()
    assert len(rows) - 1 == results["meta"]["runs"]
    bracket = results["bracket"]["rows"]
    assert len(bracket) == 8 and {(r["step_overhead_ms"], r["a2a"]) for r in bracket} >= {(0.0, False), (5.0, True)}
    plain = next(r for r in bracket if (r["step_overhead_ms"], r["a2a"]) == (0.0, False))
    worst = next(r for r in bracket if (r["step_overhead_ms"], r["a2a"]) == (5.0, True))
    assert worst["best_tpot_p50_ms"] > plain["best_tpot_p50_ms"] + 5.0, "every step pays the overhead"
    assert worst["expert_share_best"] < plain["expert_share_best"]


def test_report_runs_only_the_sections_asked_for(tmp_path: Path) -> None:
    from switchyard.simulator.offline.report import ReportOptions, build_report

    opts = ReportOptions(
        trace=ESFT_DIR, requests=AZURE_CONV, quick=True, num_requests=60, progress=False, sections=("bracket",)
    )
    md = build_report(tmp_path, opts).read_text()
    assert "## Bracket" in md and "## Fig. 11" not in md and "--sections bracket" in md
    with pytest.raises(ValueError, match="unknown report section"):
        ReportOptions(trace=ESFT_DIR, requests=AZURE_CONV, sections=("fig99",))
