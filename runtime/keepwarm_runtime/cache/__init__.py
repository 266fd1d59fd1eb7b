"""Node weight cache: a daemon keeps checkpoints resident (host memfds or CUDA VMM memory) and
inference processes attach to them zero-copy over a Unix socket (see docs/architecture.md; the wire
format is specified in protocol.py's docstring)."""
