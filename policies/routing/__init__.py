"""Routing: which prefill and which decode engine serve a request, or which one colocated engine.

Pure functions with one signature, (query, engines, state) -> (decision, state): `views` holds what
they read and return, `roles` the pair-or-colocated rule they share, `registry` finds them by name.
The scheduler service (services/scheduler) builds the views from kvmeta and carries the decision out.
"""
