"""Yuebing's data plane: the UCX block transport, the peer directory and the worker shell
that the prefill, decode and kvstore services run in."""
