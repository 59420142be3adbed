"""How `make chaos` scores issue 37's attacks (`bench/chaos_attacks.py`; no services: the harness's records filled in
by hand, and this test process's own /proc).

A hostile engine's answer reaching a client is misrouted, a hop it got and the gateway retried is not; a lying KV
claim is misrouted for what it drew beyond the claimant's share and the fix's probes (the issue's 60 of 60 is, a
fair split is not); the gateways' RSS is read from the kernel and summarised as before / peak / end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/ holds scripts, not a package
from chaos import Audit, Chaos, ChaosOptions, FaultResult, closing_line, served_by
from chaos_attacks import CLAIMANT, FAULTS, HOSTILE_ENGINES, Attacks, claim_misrouted, metric, proc_sample


def test_a_lying_claim_is_misrouted_beyond_its_share_and_a_fair_split_is_not() -> None:
    # The figure with two DP engines: the claimant served 30 of 60 in the controls and all 60 after.
    assert claim_misrouted(after=60, controls=[30, 30], requests=60, engines=2, allowance=4) == 26
    # After the fix: its share and the probes the fix lets ride on the claim (2 per gateway) are not misrouted.
    assert claim_misrouted(after=34, controls=[29, 28], requests=60, engines=2, allowance=4) == 0
    assert claim_misrouted(after=35, controls=[29, 28], requests=60, engines=2, allowance=4) == 1
    # A control above an even split raises the share (the claimant was the less loaded engine anyway).
    assert claim_misrouted(after=40, controls=[31, 36], requests=60, engines=2, allowance=4) == 0
    # Three engines (the shape): 60 of 60 against controls of 21 and 20.
    assert claim_misrouted(after=60, controls=[21, 20], requests=60, engines=3, allowance=4) == 35


def test_an_answer_a_hostile_engine_served_is_misrouted_and_counts_in_the_closing_line(tmp_path: Path) -> None:
    chaos = Chaos(ChaosOptions(workdir=tmp_path))
    chaos.root = tmp_path
    t0 = 5000.0
    stub = b'{"id": "cmpl-1", "choices": [{"text": "tok"}], "served_by": "http-e1"}'
    assert served_by(stub) == "http-e1"
    assert served_by(b"x" * 4096) == "?"  # junk relayed as a 200: no honest engine's answer
    chaos.gw_answers = [
        (t0 + 1.5, 0, 200, served_by(stub)),
        (t0 + 2.0, 1, 200, "?"),
        (t0 + 2.5, 0, 200, HOSTILE_ENGINES[0]),
        (t0 + 3.0, 1, None, ""),  # a failed attempt (retried) is not an answer
        (t0 + 20.0, 0, 200, "?"),  # outside the window
    ]
    assert chaos.attacks.not_honest(t0, t0 + 12) == 2
    fault = FaultResult("engine-bigbody", t0, t0 + 1, t0 + 12, hijacked=chaos.attacks.not_honest(t0, t0 + 12))
    chaos._score([fault], Audit())
    assert fault.misrouted == 2
    assert closing_line([fault], Audit()).endswith("misrouted 2, max resume 0.0 s")


def test_the_gateways_rss_is_read_from_the_kernel_and_summarised(tmp_path: Path) -> None:
    sample = proc_sample(os.getpid())
    assert sample is not None
    rss, hwm, cpu = sample
    assert 1 < rss <= hwm  # MiB: the interpreter alone holds more than 1 MiB; the peak is at least the current
    assert cpu > 0
    ballast = bytearray(64 << 20)  # touched: 64 MiB resident
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    grown = proc_sample(os.getpid())
    assert grown is not None and grown[0] - rss > 48, (rss, grown)
    del ballast
    attacks = Attacks(Chaos(ChaosOptions(workdir=tmp_path)), ("http-e0", "http-e1"), "stub-model")
    t0 = 100.0
    attacks.procs["gateway"] = [
        (t0, 80.0, 90.0, 10.0),
        (t0 + 3.0, 80.0, 90.0, 10.3),  # 10 % of a core before the injection
        (t0 + 4.0, 300.0, 300.0, 10.8),
        (t0 + 8.0, 82.0, 300.0, 12.8),  # 50 % during
    ]
    note = attacks.resources(injected=t0 + 3.0, end=t0 + 8.0)
    assert "gateway 80 / 300 / 82 MiB (VmHWM 90 -> 300), CPU 10 % -> 50 %" in note, note


def test_metrics_are_summed_over_the_labels_asked_for() -> None:
    samples = {
        'switchyard_router_kv_trust_total{outcome="unconfirmed"}': 3.0,
        'switchyard_router_kv_trust_total{outcome="confirmed"}': 5.0,
        'switchyard_router_engine_inflight{engine="http-e0",role="dp"}': 256.0,
        'switchyard_router_engine_inflight{engine="http-e1",role="dp"}': 1.0,
        "switchyard_router_kv_trust_created 1.7e9": 0.0,
    }
    assert metric(samples, "switchyard_router_kv_trust_total") == 8.0
    assert metric(samples, "switchyard_router_kv_trust_total", outcome="unconfirmed") == 3.0
    assert metric(samples, "switchyard_router_engine_inflight", engine=CLAIMANT) == 256.0
    assert set(FAULTS) >= {"engine-bigbody", "engine-hugeheader", "kv-claim", "kv-flood", "decision-flood"}
