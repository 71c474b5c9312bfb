"""Admission: the public OpenAI-compatible front door (API keys, rate limits, the request lifecycle)."""
