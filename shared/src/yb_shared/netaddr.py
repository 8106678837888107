"""Which interface a listener binds to, and whether that is this machine only.

Listeners that carry no authentication of their own (metrics, the NATS monitor) are
safe on loopback and nowhere else; `is_loopback` is the one test every listener uses
to decide whether it must insist on a token.
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
