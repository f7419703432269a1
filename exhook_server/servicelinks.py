"""Recognises the environment variables a kubelet injects for Services ("service links").

For every Service in a pod's namespace the kubelet sets `<SVC>_SERVICE_HOST`,
`<SVC>_SERVICE_PORT[_<PORT NAME>]`, `<SVC>_PORT` and `<SVC>_PORT_<n>_<PROTO>[_PROTO|_PORT|_ADDR]`,
where `<SVC>` is the Service's name upper-cased with `-` as `_`: a Service named `sdv-fanout`
or `sdv-fanout-db-rw` gives variables that start like our settings' (`SDV_FANOUT_`).
`is_service_link` tells them apart from a setting by name AND value shape (an IP address, a
port number, `tcp://IP:port`, a protocol), so a misspelt setting is still refused.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

_PROTOS = ("tcp", "udp", "sctp")


def _ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _port(value: str) -> bool:
    return value.isdigit() and 0 < int(value) <= 65535


def _url(value: str) -> bool:
    """`tcp://10.96.0.10:9000`, or with an IPv6 ClusterIP `tcp://[fd00::10]:9000` (kubelets that
    wrote it without brackets, `tcp://fd00::10:9000`, are accepted too)."""
    proto, sep, rest = value.partition("://")
    host, colon, port = rest.rpartition(":")
    if not (sep and colon and proto in _PROTOS and _port(port)):
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return _ip(host)


def _proto(value: str) -> bool:
    return value in _PROTOS


_SVC = r"[A-Z][A-Z0-9_]*"
_SHAPES: tuple[tuple[re.Pattern[str], Callable[[str], bool]], ...] = tuple(
    (re.compile(rf"{_SVC}_{suffix}"), check)
    for suffix, check in (
        ("SERVICE_HOST", _ip),
        (r"SERVICE_PORT(?:_[A-Z0-9_]+)?", _port),
        ("PORT", _url),
        (r"PORT_\d{1,5}_(?:TCP|UDP|SCTP)", _url),
        (r"PORT_\d{1,5}_(?:TCP|UDP|SCTP)_PROTO", _proto),
        (r"PORT_\d{1,5}_(?:TCP|UDP|SCTP)_PORT", _port),
        (r"PORT_\d{1,5}_(?:TCP|UDP|SCTP)_ADDR", _ip),
    )
)


def is_service_link(name: str, value: str) -> bool:
    """Whether the variable `name=value` has the name and the value a kubelet gives a service link."""
    return any(pattern.fullmatch(name) and check(value) for pattern, check in _SHAPES)
