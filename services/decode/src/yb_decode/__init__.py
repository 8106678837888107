"""The decode engine service."""

__version__ = "0.1.0"
