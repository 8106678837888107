"""Which interface a listener binds to, and whether that is this machine only.

Listeners that carry no authentication of their own (metrics, the NATS monitor) are
safe on loopback and nowhere else; `is_loopback` is the one test every listener uses
to decide whether it must insist on a token. UCX takes a device, not an address:
`interface_of` names the one that holds a configured address.
"""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address.

    '' and the wildcard addresses (`0.0.0.0`, `::`) mean every interface: not
    loopback. A name is resolved, and counts only if all its addresses are loopback,
    so a name that also resolves to a routable address is treated as exposed.
    """
    host = host.strip().strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(str(a).split("%", 1)[0]).is_loopback for a in addresses
    )


def is_wildcard(host: str) -> bool:
    """True for '' and the any-address of either family: every interface."""
    return host.strip().strip("[]") in ("", "0.0.0.0", "::")


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address `host` on this machine.

    A loopback address is the loopback device (Linux's `lo` answers all of
    127.0.0.0/8); a name is resolved to its first address. None when no interface
    holds it (or `host` is a wildcard: that is every interface, not one).
    """
    if is_wildcard(host):
        return None
    host = host.strip().strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
        except (OSError, IndexError, ValueError):
            return None
    for index, name in socket.if_nameindex():
        del index
        if address in _addresses_of(name) or (address.is_loopback and name == "lo"):
            return name
    return None


def _addresses_of(interface: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses of one interface (Linux: an ioctl for IPv4, /proc for IPv6)."""
    import fcntl
    import struct

    found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("256s", interface.encode()[:15])
        try:
            reply = fcntl.ioctl(sock.fileno(), siocgifaddr, request)
            found.add(ipaddress.IPv4Address(reply[20:24]))
        except OSError:
            pass  # no IPv4 address
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) == 6 and fields[5] == interface:
                    found.add(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    except OSError:
        pass
    return found
