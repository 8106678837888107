"""Where a UCX listener can be reached."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Host and port of a process's UCX listener.

    Events and control messages carry it as the string `"host:port"` (`str(addr)` and
    `PeerAddress.parse`); an IPv6 host is bracketed, `"[::1]:5000"`. msgspec structs
    should declare the field as `str` and convert at the edge, so the wire format stays
    a plain string that any reader understands.
    """

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("PeerAddress needs a host")
        if not 0 < self.port < 65536:
            raise ValueError(f"PeerAddress port out of range: {self.port}")

    def __str__(self) -> str:
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Parse `"host:port"` or `"[v6host]:port"`; raises ValueError otherwise."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"not a host:port address: {text!r}")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return cls(host, int(port))

    def to_wire(self) -> str:
        """The `"host:port"` string used in msgspec structs."""
        return str(self)

    @classmethod
    def from_wire(cls, text: str) -> PeerAddress:
        """Inverse of `to_wire`."""
        return cls.parse(text)
