"""Real traces shipped with Switchyard, so a bare clone and an installed wheel run without anything beside them.

Provenance, licences and checksums are in `README.md` beside this file. Callers name a file by its path
relative to this folder; `trace_path` lets a user's own folder of the same layout win where it has the file.
"""

from __future__ import annotations

from pathlib import Path

#: The folder of shipped data (inside the installed package).
SHIPPED_DIR = Path(__file__).resolve().parent

#: DeepSeek-V2-Lite per-token expert selections (routing trace, `esft` format).
ESFT = "routing/esft_deepseek_v2_lite"
#: Azure LLM inference trace 2023: request arrivals and token lengths.
AZURE_CONV = "requests/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = "requests/azure_llm_2023/AzureLLMInferenceTrace_code.csv"
#: Mooncake's FAST'25 synthetic trace (JSONL with 512-token prefix block hashes): prefix caching.
MOONCAKE_SYNTHETIC = "requests/mooncake_fast25/synthetic_trace.jsonl"
#: SGLang's DeepSeek-V3 per-expert load statistics (expert-load windows for calibration).
SGLANG_EXPERT_LOAD = "expert_load/sglang_deepseek_v3"


def trace_path(relative: str, trace_dir: Path | None = None) -> Path:
    """`trace_dir / relative` when a user's folder is given and has it, else the shipped copy."""
    if trace_dir is not None:
        candidate = Path(trace_dir) / relative
        if candidate.exists():
            return candidate
    return SHIPPED_DIR / relative
