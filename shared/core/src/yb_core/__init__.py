"""Yuebing's contracts and control plane: events, protocol, hashing, config, the bus,
the service base, presence, telemetry and auth. No torch, no UCX."""

__version__ = "0.2.0"
