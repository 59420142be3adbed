"""The OpenAI-compatible gateway: Switchyard in the request path (issue 12)."""
