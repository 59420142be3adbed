"""Shared by the real-vLLM tests (`tests/test_vllm_*.py`): the tiny random Qwen3-MoE and reading engine output."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LAYERS, EXPERTS, TOP_K = 2, 8, 2

#: The engine arguments every `LLM(...)` of these tests shares, eager or compiled. vLLM keys its torch.compile
#: cache (`$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>`, inductor's own cache inside it) on the
#: model's path and dtype, max_model_len, block size, max_num_seqs and max_num_batched_tokens among others: with
#: one configuration, one model and one cache per session (`tiny_moe_once`, `engine_env`) the compiled engines
#: share one key. The first compiles; vLLM 0.32's CPU build then fails to load its AOT artifact in the others
#: ("Compiling model again due to a load failure ... no attribute 'finalize_loading'") and recompiles, which
#: inductor's FX graph cache under the same key answers (about 5 s instead of 20-25 s). vLLM's key knows nothing
#: of the ops the Switchyard agent attaches: every engine here runs the agent with the same capture settings
#: (routing samples on, signatures on), so that one key means one graph. float32: the signatures are compared
#: with transformers' router logits exactly; 32-token blocks: the CPU attention's unit.
ENGINE_ARGS = 'max_model_len=256, max_num_seqs=4, dtype="float32", block_size=32, gpu_memory_utilization=0.1'

MAKE_MODEL = """
import sys, torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers={layers}, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts={experts},
    num_experts_per_tok={top_k}, max_position_embeddings=1024, decoder_sparse_step=1, norm_topk_prob=True)
torch.manual_seed(0)
Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
tok = Tokenizer(models.WordLevel(vocab={{f"t{{i}}": i for i in range(512)}}, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2",
    pad_token="t3").save_pretrained(sys.argv[1])
"""


def make_tiny_moe(path: Path) -> Path:
    """A random Qwen3-MoE small enough for vLLM's CPU backend, with a word-level tokenizer (one token a word)."""
    make = MAKE_MODEL.format(layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    subprocess.run([sys.executable, "-c", make, str(path)], check=True, capture_output=True, timeout=300)
    return path


def tiny_moe_once(factory: pytest.TempPathFactory) -> Path:
    """The session's one tiny MoE: every module's engines load the same path, which vLLM's compile cache keys on."""
    path = factory.getbasetemp() / "tiny-moe"
    if not (path / "config.json").exists():
        built = make_tiny_moe(factory.mktemp("tiny-moe-build"))
        built.rename(path)  # whole or absent: a module that comes later never sees half a model
    return path


def engine_env(factory: pytest.TempPathFactory, **extra: str) -> dict[str, str]:
    """The environment of an engine subprocess: offline, and the session's own compile caches.

    vLLM's cache (AOT-compiled graphs, inductor's kernels) goes under this session's temporary directory, not
    `~/.cache/vllm`: every run starts cold, as a bare clone's CI does, and compiles once (the first compiled
    engine); nothing compiled by another run, another checkout or another vLLM is ever read. (inductor's
    precompiled header stays machine-wide in /tmp/torchinductor_<user>: the first compile on a machine builds it.)
    """
    cache = factory.getbasetemp() / "vllm-cache"
    cache.mkdir(exist_ok=True)
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        # vLLM compiles with `cpp.dynamic_threads` on, and its key includes inductor's global config: a worker
        # in the engine's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) has it off there, a worker process on
        # (vLLM 0.32), so the two would compile twice. On from the start, every worker keys the same.
        "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1",
        **extra,
    }


async def result_line(engine: asyncio.subprocess.Process, prefix: bytes) -> dict:
    """The script's JSON line starting with `prefix`, past vLLM's own log lines on stdout (passed on to stderr,
    which pytest shows with a failure, and `-s` as they come: the compile cache's messages are among them)."""
    while line := await engine.stdout.readline():  # type: ignore[union-attr]
        if line.startswith(prefix):
            return json.loads(line)
        sys.stderr.write(line.decode(errors="replace"))
    raise AssertionError("the engine exited before serving (its log is above)")


def external_id(engine_request_id: str) -> str:
    """vLLM's internal request id is `<the client's id>-<8 random characters>`."""
    return engine_request_id.rsplit("-", 1)[0]
