"""The conductor: Yuebing's global, event-sourced scheduler."""

__version__ = "0.2.0"
