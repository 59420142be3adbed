"""One BLAS thread, so a benchmark computes on one core (the budgets are per core). Import before numpy.

The machine is shared: wall time includes waiting for the CPU, so benchmarks also report process CPU
time, which is what one core spends on the work.
"""

from __future__ import annotations

import os

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[variable] = "1"


def machine() -> str:
    """One line describing where the figures were measured."""
    import platform

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{model}, {os.cpu_count()} cores (1 BLAS thread), Python {platform.python_version()}, load {load:.2f}"
