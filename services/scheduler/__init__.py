"""The scheduler service: cluster routing, which prefill and which decode engine serve a request."""
