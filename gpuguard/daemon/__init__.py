"""The daemon's edge: the event loop, the socket, the operations, admission and metrics."""
