"""Scorers: per-engine costs, lower is better, summed with weights (one small module per scorer)."""

from switchyard.solver.routing.scorers.affinity import ExpertAffinity
from switchyard.solver.routing.scorers.column import Column
from switchyard.solver.routing.scorers.dynamo import DynamoDecode, DynamoPrefill
from switchyard.solver.routing.scorers.gimbal import KvPenalty, MoePenalty
from switchyard.solver.routing.scorers.llmd import LlmdKvUtilization, LlmdPrefix, LlmdQueue
from switchyard.solver.routing.scorers.prefix import UncachedPrompt
from switchyard.solver.routing.scorers.sglang import SglangCacheAware
from switchyard.solver.routing.scorers.vllm import VllmMainKv, VllmMainLoad

__all__ = [
    "Column",
    "DynamoDecode",
    "DynamoPrefill",
    "ExpertAffinity",
    "KvPenalty",
    "LlmdKvUtilization",
    "LlmdPrefix",
    "LlmdQueue",
    "MoePenalty",
    "SglangCacheAware",
    "UncachedPrompt",
    "VllmMainKv",
    "VllmMainLoad",
]
