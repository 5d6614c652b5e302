"""The gateway's URL as agents on other hosts reach it (an agent service, client fleets).

The coordinator reaches a gateway it started at a loopback address when the gateway listens on
a wildcard host (0.0.0.0, ::); that URL is no use to a service on another machine, which would
call itself. So what a run tells agents elsewhere is `gateway.advertise_url` when set, else the
coordinator's URL with a wildcard host replaced by this machine's address.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
# A documentation-only address (TEST-NET-1, RFC 5737): connecting a UDP socket to it sends
# nothing, it only makes the kernel pick the interface of the default route.
_ROUTE_PROBE = ("192.0.2.1", 9)


def this_host_address() -> str:
    """This machine's address on the interface of its default route; its host name when it
    has no such route (an isolated machine or container)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(_ROUTE_PROBE)
            address = str(probe.getsockname()[0])
    except OSError:
        address = ""
    if address and not ipaddress.ip_address(address).is_loopback:
        return address
    return socket.gethostname()


def advertised_url(
    url: str,
    listen_host: str | None,
    advertise_url: str | None = None,
    *,
    address: Callable[[], str] = this_host_address,
) -> str:
    """What agents elsewhere are told for the gateway the coordinator reaches at `url`, which
    listens on `listen_host` (None: a gateway the run did not start, told as it was given)."""
    if advertise_url is not None:
        return advertise_url
    if listen_host is None or listen_host not in WILDCARD_HOSTS:
        return url
    parts = urlsplit(url)
    host = address()
    if ":" in host:
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))
