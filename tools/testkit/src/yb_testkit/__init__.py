"""Yuebing's test kit (development only): pytest fixtures that start real NATS servers
and clusters, network-namespace hosts, and fault-injection helpers."""
