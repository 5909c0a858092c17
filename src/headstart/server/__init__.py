"""HTTP-facing pieces of the headstart server: protocol, reasoning split, auth, logs, metrics."""
