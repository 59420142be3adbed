"""Routing policies: decode-engine choice at the prefill->decode handoff, and data-parallel dispatch."""
