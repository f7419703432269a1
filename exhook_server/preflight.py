"""Start-up checks that turn the usual first-hour mistakes into one line naming the setting.

`check(cfg)` runs before anything else of `serve` (before the data dir is locked, before any
server process is forked, before gRPC exists): a data_dir that is not a writable directory, a
TLS file it cannot read, and a `listen`, `admin_listen` or `metrics_listen` address something
else already holds raise `ConfigError("<setting> <value>: <why>")`, which the CLI prints as one
line, exit code 2. The binds that follow still report a failure under the setting's name (a
port can be taken between the check and the bind).
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from exhook_server.backends.backend import local_data_dir
from exhook_server.config import Config, split_host_port
from exhook_server.errors import ConfigError

#: The settings naming an address this server listens on.
LISTENERS = ("listen", "admin_listen", "metrics_listen")
#: The settings naming a file the server reads at start (TLS for its listeners and its MQTT link).
FILES = ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "mqtt_ca_file")


def check(cfg: Config) -> None:
    """Raise ConfigError naming the first setting the server cannot start with."""
    data_dir = local_data_dir(cfg)
    if data_dir is not None:  # PostgreSQL mode neither creates nor uses data_dir
        check_data_dir(data_dir)
    for name in FILES:
        path = getattr(cfg, name)
        if path:
            check_file(name, path)
    for name in LISTENERS:
        address = getattr(cfg, name)
        if address:
            check_address(name, address)


def check_data_dir(data_dir: str) -> None:
    """data_dir is a directory (created if missing) this process can create files in."""
    path = Path(data_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"data_dir {data_dir}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data_dir {data_dir}: cannot create it: {exc.strerror}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=path)
    except OSError as exc:
        raise ConfigError(f"data_dir {data_dir}: not writable: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def check_file(name: str, path: str) -> None:
    """The file setting `name` names can be read."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"{name} {path}: cannot read it: {(exc.strerror or str(exc)).lower()}") from None


def check_address(name: str, address: str) -> None:
    """Nothing else listens on `address` (port 0 means any free port: always fine).

    A plain bind, without SO_REUSEPORT: it fails on a port another server holds, whether that
    server shares its port (a group of ours, gRPC's default) or not."""
    host, port = split_host_port(address)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT left by our last run is no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"{name} {address}: {bind_error(exc)}") from None


def bind_error(exc: OSError) -> str:
    """The reason a bind failed, in words (errno's, lower case)."""
    return (exc.strerror or str(exc)).lower()
