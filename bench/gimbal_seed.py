"""The Gimbal seed's experiments on the DP+EP fleet simulator, each beside the seed's number.

Setting, as the seed where the data exists: DP=2 engines x TP=2 H100, experts parallel over all 4 GPUs
(vLLM DP+EP, lock-step); Qwen3-30B-A3B physics on the ESFT routing trace's selections (`--borrow-routing`:
the only real per-token routing trace shipped is DeepSeek-V2-Lite's; docs/gimbal-seed.md says what that
changes); request lengths from the shipped BurstGPT excerpt (383 real requests, cycled), Poisson arrivals at
the target rate (the excerpt's own arrivals average one per 97 s).

Configurations (`simulator.offline.report.gimbal_seed.VARIANTS`), each a `switchyard sim-dp` run:

- `vllm`: vLLM's DP rule, FCFS, EPLB-style load-only placement (the seed's baseline);
- `gimbal`: Gimbal's dispatch (Algorithm 1), SJF with aging (Algorithm 2), Gimbal's source-aware placement
  with the MINLP-calibrated weights: the full, coordinated system;
- ablation: `dp-only` (Gimbal dispatch + order, EPLB placement), `ep-only` (vLLM dispatch + FCFS, Gimbal
  placement), `uncoordinated` (both sides, but the dispatcher does not read MoE pressure: the seed's
  coordination is "feeding backend MoE pressure to the DP scheduler"; `--dp-weights moe_penalty=0`);
- `gimbal-uncalibrated`: the greedy placement without the calibrated weights;
- `vllm-static`: control, vLLM with no rebalancing at all (placement `none`).

Loads: the seed's RPS 2, 3 and 4 (the simulated fleet is nearly idle there: datasheet-speed engines, no CPU
overhead), then heavier rates chosen from vLLM's running count alone (`HEAVY_RATES`), before any other
configuration was compared. Gimbal vs vLLM runs at every load; the ablation, the calibration and the static
control at 100 req/s (`PLAN`: the CPU budget). Three seeds (routing draws, telemetry phases, arrivals).

Writes `runs.csv` (one row per run), `results.json` (how it was run, the comparisons) and `report.md` into
`--out` (default docs/results/gimbal_seed). `--report-only` rebuilds the report from the files; `--quick`
runs one seed, two loads, Gimbal vs vLLM, 150 requests (a few CPU minutes). Budget: the full bench takes at most 15 CPU
minutes (`results.json` records the CPU time it took).
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _single_core  # before numpy: one BLAS thread; and the machine line

from switchyard.simulator.offline.report.gimbal_seed import VARIANTS, compare, markdown, read_runs

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = "data/requests/burstgpt/BurstGPT_1_first400.csv"
SEED_RATES = (2.0, 3.0, 4.0)
#: Heavier loads (req/s), chosen from vLLM+FCFS+EPLB's mean running requests per engine alone, before any other
#: configuration was compared: at 100 req/s vLLM runs 48 requests per engine over these short runs and 132 over a
#: minute of arrivals, bracketing the seed's 88 at its RPS 4 ("Runtime Behavior at RPS=4"); 400 req/s is near
#: vLLM's TTFT knee.
HEAVY_RATES = (100.0, 400.0)
#: Which configurations run where (the CPU budget: a DP+EP run costs ~25 ms of CPU per request plus ~1 ms per
#: step): the headline pair everywhere, the ablation, the calibration and the control at the seed-like load.
HEADLINE = ("vllm", "gimbal")
PLAN: dict[float, tuple[str, ...]] = {
    2.0: HEADLINE,
    3.0: HEADLINE,
    4.0: HEADLINE,
    100.0: tuple(VARIANTS),
    400.0: HEADLINE,
}
#: Requests per run: 50 s of arrivals at the seed's rates (idle fleets step every few ms, so steps, not
#: requests, cost CPU there), 600 requests at the heavier rates (6 s and 1.5 s of arrivals).
REQUESTS_AT = {2.0: 100, 3.0: 150, 4.0: 200, 100.0: 600, 400.0: 600}
QUICK_REQUESTS = 150
METRICS = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99", "throughput")
EXTRA = ("offered_rate", "mean_running", "busy_fraction", "max_kv_usage", "preemptions", "prompt_tput_gap")
#: Placement figures `sim-dp` may report per run (docs/ep-simulation.md); kept when present.
EP_EXTRA = (
    "ep_migrations",
    "ep_moves",
    "ep_migration_s",
    "ep_slowed_s",
    "ep_a2a_nvlink_bytes_per_token",
    "ep_a2a_network_bytes_per_token",
    "ep_a2a_fraction",
    "ep_load_max_mean",
    "ep_predicted_gain_s",
    "ep_predicted_cost_s",
    "ep_measured_gain_s",
    "ep_predicted_gain_checked_s",
    "ep_deferred",
    "ep_waiting_mean",
)
COLUMNS = ("variant", "key", "dispatch", "order", "placement", "dp_weights", "rate", "seed", "requests")


def groups(names: tuple[str, ...] = tuple(VARIANTS)) -> dict[tuple[str, str, str], list[tuple[str, str]]]:
    """(dispatch, order, weights) -> [(variant, placement)]: one `sim-dp` call per group runs its placements."""
    out: dict[tuple[str, str, str], list[tuple[str, str]]] = {}
    for name in names:
        dispatch, order, placement, weights = VARIANTS[name]
        out.setdefault((dispatch, order, weights), []).append((name, placement))
    return out


def command(
    dispatch: str, order: str, weights: str, placements: list[str], rate: float, n: int, seed: int
) -> list[str]:
    """The `switchyard sim-dp` arguments of one group at one load and seed."""
    args = ["sim-dp", "--requests", REQUESTS, "--rate", f"{rate:g}", "--num-requests", str(n)]
    args += ["--engines", "2", "--tp", "2", "--gpu", "H100", "--model", "qwen3-30b-a3b", "--borrow-routing"]
    args += ["--dispatch", dispatch, "--order", order, "--placement", ",".join(placements), "--seed", str(seed)]
    if weights:
        args += ["--dp-weights", weights]
    return args


def run_group(task: dict) -> list[dict]:
    """One `sim-dp` subprocess; its JSON's runs keyed `<dispatch>+<order>+<placement>` become rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        argv = [sys.executable, "-m", "switchyard.cli", *task["args"], "--json", str(out)]
        t0 = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"sim-dp failed ({done.returncode}): {shlex.join(task['args'])}\n{done.stderr[-2000:]}")
        payload = json.loads(out.read_text())
    rows = []
    for variant, placement in task["members"]:
        key = f"{task['dispatch']}+{task['order']}+{placement}"
        s = payload["runs"][key]
        row = {"variant": variant, "key": key, "dispatch": task["dispatch"], "order": task["order"]}
        row.update(placement=placement, dp_weights=task["weights"], rate=task["rate"], seed=task["seed"])
        row.update(requests=s["requests"])
        row.update({k: s[k] for k in METRICS + EXTRA})
        row.update({k: s[k] for k in EP_EXTRA if isinstance(s.get(k), int | float)})
        rows.append(row)
    print(
        f"  rate {task['rate']:g} seed {task['seed']} {task['dispatch']}+{task['order']} "
        f"{'+'.join(p for _, p in task['members'])}{' ' + task['weights'] if task['weights'] else ''}: "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    return rows


def tasks(seeds: list[int], quick: bool) -> list[dict]:
    plan = {4.0: HEADLINE, 100.0: HEADLINE} if quick else PLAN
    out = []
    for rate, names in plan.items():
        n = QUICK_REQUESTS if quick else REQUESTS_AT[rate]
        for seed in seeds:
            for (dispatch, order, weights), members in groups(names).items():
                placements = [p for _, p in members]
                out.append(
                    {
                        "dispatch": dispatch,
                        "order": order,
                        "weights": weights,
                        "members": members,
                        "rate": rate,
                        "seed": seed,
                        "args": command(dispatch, order, weights, placements, rate, n, seed),
                    }
                )
    return out


def commands_md(rates: list[float]) -> list[str]:
    """The `sim-dp` command of every configuration (seed 0), for the report."""
    lines = ["## Commands (seed 0; `--seed 1`, `--seed 2` for the others)", "", "```sh"]
    for rate in rates:
        n = REQUESTS_AT.get(rate, QUICK_REQUESTS)
        for (dispatch, order, weights), members in groups(PLAN.get(rate, HEADLINE)).items():
            args = command(dispatch, order, weights, [p for _, p in members], rate, n, 0)
            lines.append(f"switchyard {shlex.join(args)}  # {', '.join(v for v, _ in members)}")
    return [*lines, "```", ""]


def write_csv(rows: list[dict], path: Path) -> None:
    extra = [k for k in EP_EXTRA if any(k in r for r in rows)]
    keys = [*COLUMNS, *METRICS, *EXTRA, *extra]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in sorted(rows, key=lambda r: (r["rate"], r["seed"], list(VARIANTS).index(r["variant"]))):
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k, "")) for k in keys})


def write_report(meta: dict, rows: list[dict], out: Path) -> dict:
    cmp = compare(rows)
    rates = sorted({float(r["rate"]) for r in rows})
    lines = [
        "# The Gimbal seed's experiments on the DP+EP fleet simulator",
        "",
        "Generated by `bench/gimbal_seed.py` (`--report-only` rebuilds this from `runs.csv`); the model, the "
        "borrowed routing, what is modelled and the reading of these numbers: `docs/gimbal-seed.md`.",
        "",
        f"Fleet: DP2 TP2 EP4 lock-step on H100; Qwen3-30B-A3B physics on the ESFT (DeepSeek-V2-Lite) routing "
        f"trace's selections; BurstGPT lengths (`{REQUESTS}`, 383 requests, cycled), Poisson arrivals. "
        f"Seeds {', '.join(map(str, meta['seeds']))}. Runs: {len(rows)}. "
        f"Code: {meta.get('commit', '?')}. Machine: {meta['machine']}; {meta['cpu_s']:.0f} CPU s, "
        f"{meta['wall_s']:.0f} s wall" + (" (quick)" if meta.get("quick") else "") + ".",
        "",
        *markdown(cmp, "docs/results/gimbal_seed/runs.csv")[2:],
        *commands_md(rates),
    ]
    (out / "report.md").write_text("\n".join(lines))
    return cmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "gimbal_seed")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one seed, RPS 4 and 100, 150 requests, Gimbal vs vLLM")
    ap.add_argument("--report-only", action="store_true", help="rebuild report.md and results.json from the files")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta_path, csv_path = args.out / "results.json", args.out / "runs.csv"
    if args.report_only:
        meta = json.loads(meta_path.read_text())["meta"]
    else:
        probe = subprocess.run(
            [sys.executable, "-m", "switchyard.cli", "sim-dp", "--help"], capture_output=True, text=True
        )
        if "--placement" not in probe.stdout:
            sys.exit(
                "sim-dp has no --placement option yet: this bench needs the DP+EP simulation (docs/ep-simulation.md)"
            )
        seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
        todo = tasks(seeds, args.quick)
        print(f"{len(todo)} sim-dp runs on {args.jobs} processes", flush=True)
        t0 = time.perf_counter()
        rows: list[dict] = []
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # threads wait; the work is in subprocesses
            for part in pool.map(run_group, todo):
                rows += part
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        meta = {
            "machine": _single_core.machine(),
            "wall_s": time.perf_counter() - t0,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "seeds": seeds,
            "quick": args.quick,
            "rates": sorted({r["rate"] for r in rows}),
            "requests": REQUESTS,
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
            ).stdout.strip(),
        }
        write_csv(rows, csv_path)
    rows = read_runs(csv_path)
    cmp = write_report(meta, rows, args.out)
    meta_path.write_text(json.dumps({"meta": meta, "compare": cmp}, indent=1, default=float) + "\n")
    print(f"report: {args.out / 'report.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
