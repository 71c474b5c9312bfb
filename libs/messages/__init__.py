"""The services' wire contracts, one struct for sender and receiver: the engine's (engine.py), the
scheduler's (scheduler.py) and the predictor's (predictor.py) request and response bodies; kvmeta's
are libs/kvmeta/messages.py. Services still meet only over HTTP: these are message types, not calls."""
