"""The Gimbal seed section of `switchyard report`: each experiment's change beside the seed's number, losses
included, computed from the bench's runs; the committed report is what its runs.csv regenerates."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from switchyard.simulator.offline.report.gimbal_seed import (
    DEFAULT_RESULTS,
    SEED_GIMBAL,
    VARIANTS,
    compare,
    markdown,
    read_runs,
)

#: Per variant, (TTFT, TPOT) in s at seed 0; seed 1 is 10 % slower for everyone.
TIMES = {
    "vllm": (0.100, 0.020),
    "gimbal": (0.050, 0.018),
    "dp-only": (0.060, 0.020),
    "ep-only": (0.110, 0.019),  # a loss on TTFT
    "uncoordinated": (0.0625, 0.018),
    "gimbal-uncalibrated": (0.040, 0.020),  # calibration loses on TTFT here
    "vllm-static": (0.100, 0.021),
}


def _runs(path: Path, rates: tuple[float, ...] = (4.0, 200.0)) -> Path:
    keys = ["variant", "key", "dispatch", "order", "placement", "dp_weights", "rate", "seed", "requests"]
    keys += ["ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99", "throughput", "offered_rate", "mean_running"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for rate in rates:
            for seed, slow in ((0, 1.0), (1, 1.1)):
                for name, (dispatch, order, placement, weights) in VARIANTS.items():
                    ttft, tpot = TIMES[name]
                    w.writerow(
                        {
                            "variant": name,
                            "key": f"{dispatch}+{order}+{placement}",
                            "dispatch": dispatch,
                            "order": order,
                            "placement": placement,
                            "dp_weights": weights,
                            "rate": rate,
                            "seed": seed,
                            "requests": 100,
                            "ttft_mean": ttft * slow,
                            "ttft_p99": 3 * ttft * slow,
                            "tpot_mean": tpot * slow,
                            "tpot_p99": 2 * tpot * slow,
                            "throughput": 1000.0 / slow,
                            "offered_rate": rate,
                            "mean_running": 5.0,
                        }
                    )
    return path


def test_changes_are_paired_by_seed_and_keep_losses(tmp_path: Path) -> None:
    cmp = compare(read_runs(_runs(tmp_path / "runs.csv")))
    head = {h["rate"]: h for h in cmp["headline"]}
    assert set(head) == {4.0, 200.0}
    assert head[4.0]["delta"]["ttft_mean"]["mean"] == pytest.approx(-50.0)
    assert head[4.0]["delta"]["tpot_mean"]["mean"] == pytest.approx(-10.0)
    assert head[4.0]["delta"]["ttft_mean"]["seeds"] == 2
    abl = {(a["rate"], a["variant"]): a["delta"] for a in cmp["ablation"]}
    assert abl[(4.0, "ep-only")]["ttft_mean"]["mean"] == pytest.approx(10.0), "a loss stays a loss"
    assert abl[(4.0, "coordinated vs uncoordinated")]["ttft_mean"]["mean"] == pytest.approx(-20.0)
    calib = {c["rate"]: c["delta"] for c in cmp["calibration"]}
    assert calib[200.0]["ttft_mean"]["mean"] == pytest.approx(25.0)
    assert cmp["seed_rate_mean"]["ttft_mean"] == pytest.approx(-50.0), "only RPS <= 4 enter the seed's average"


def test_markdown_puts_the_seeds_numbers_beside_ours(tmp_path: Path) -> None:
    md = "\n".join(markdown(compare(read_runs(_runs(tmp_path / "runs.csv"))), "runs.csv"))
    assert f"{SEED_GIMBAL['ttft_mean']:+.1f} %" in md and f"{SEED_GIMBAL['tpot_mean']:+.1f} %" in md
    assert "−48.3 %" in md or "-48.3 %" in md
    assert "| 4 | ep-only | +10.0 % [+10.0, +10.0]" in md, "losses printed with their sign"
    assert "| 200 | +25.0 % [+25.0, +25.0]" in md and f"{SEED_GIMBAL['calibration_ttft']:+.1f} % TTFT" in md
    assert "coordinated vs uncoordinated" in md and f"{SEED_GIMBAL['coordination_ttft']:+.1f} % TTFT" in md


def test_report_section_reads_a_runs_folder(tmp_path: Path) -> None:
    from switchyard.simulator.offline.report import ReportOptions, build_report
    from tests.conftest import SHIPPED_DATA

    folder = tmp_path / "runs"
    folder.mkdir()
    _runs(folder / "runs.csv")
    opts = ReportOptions(
        trace=SHIPPED_DATA / "routing" / "esft_deepseek_v2_lite",
        requests=SHIPPED_DATA / "requests" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv",
        quick=True,
        num_requests=40,
        progress=False,
        sections=("gimbal",),
        gimbal_results=folder,
    )
    md = build_report(tmp_path / "out", opts).read_text()
    assert "## Gimbal seed" in md and "| 4 | ep-only | +10.0 %" in md
    empty = ReportOptions(**{**opts.__dict__, "gimbal_results": tmp_path / "nowhere"})
    assert "No runs at" in build_report(tmp_path / "out2", empty).read_text()


@pytest.mark.skipif(not (DEFAULT_RESULTS / "runs.csv").exists(), reason="bench/gimbal_seed.py not run yet")
def test_committed_report_is_what_its_runs_regenerate() -> None:
    committed = (DEFAULT_RESULTS / "report.md").read_text()
    section = markdown(compare(read_runs(DEFAULT_RESULTS / "runs.csv")), "docs/results/gimbal_seed/runs.csv")[2:]
    assert "\n".join(section) in committed, "rerun `bench/gimbal_seed.py --report-only` after changing the section"
