"""`switchyard report`: the ELDR seed's experiments regenerated on real traces, Markdown + PNG.

Fig. 2 (MoE-layer time vs active experts and batch) and Fig. 4 (same-domain vs mixed batches) need no
serving run; Fig. 11 (TPOT/TTFT vs rate, every policy, 8P16D), Fig. 15 (balanced vs vanilla K-means),
Fig. 16 (τ sweep) and Table 2 (8/16/24 decoders) are discrete-event simulations replaying the ESFT routing
trace with the Azure conversation trace's arrivals and lengths. Each section prints the seed's numbers
beside the simulated ones. `--quick` shrinks every experiment so the whole report takes seconds.

One module per section (`fig2`, `fig4`, `fig11`, `fig15`, `fig16`, `table2`, `bracket`), each a `build`
function from a `ReportContext` to the section's results and Markdown; `compose.build_report` runs the asked
sections in order and writes `report.md`, the PNGs, `results.json` and `runs.csv`. The options and the
seed's numbers are `options`, the cached simulation runs `runner`.
"""

from switchyard.simulator.offline.report.compose import build_report
from switchyard.simulator.offline.report.options import SECTIONS, ReportOptions

__all__ = ["SECTIONS", "ReportOptions", "build_report"]
