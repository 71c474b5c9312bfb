"""Same-host data plane: a peer maps our registered memory and a READ or WRITE is a copy."""
