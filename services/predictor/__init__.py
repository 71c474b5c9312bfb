"""The predictor service: output lengths with CacheOpt's confidence padding, learned from actual lengths."""
