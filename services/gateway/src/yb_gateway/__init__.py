"""Yuebing's gateway: the OpenAI-compatible HTTP + SSE front door of the cluster.

It authenticates and validates requests, tokenizes them, asks the conductor for a
placement through the event log, hands the job to the chosen prefill instance and
relays the decode instance's tokens to the client.
"""

from __future__ import annotations

__version__ = "0.1.0"
