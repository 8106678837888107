"""Yuebing shared library: events, bus, hashing, transport, model runner, config, telemetry."""

__version__ = "0.1.0"
