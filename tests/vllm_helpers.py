"""Shared by the real-vLLM tests (`tests/test_vllm_*.py`): the tiny random Qwen3-MoE and reading engine output."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

LAYERS, EXPERTS, TOP_K = 2, 8, 2

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


async def result_line(engine: asyncio.subprocess.Process, prefix: bytes) -> dict:
    """The script's JSON line starting with `prefix`, past vLLM's own log lines on stdout."""
    while line := await engine.stdout.readline():  # type: ignore[union-attr]
        if line.startswith(prefix):
            return json.loads(line)
    raise AssertionError("the engine exited before serving (its log is above)")


def external_id(engine_request_id: str) -> str:
    """vLLM's internal request id is `<the client's id>-<8 random characters>`."""
    return engine_request_id.rsplit("-", 1)[0]
