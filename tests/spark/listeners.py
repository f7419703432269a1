"""Run by tests/spark/test_local_session.py in a process of its own: start a job's session the way
a job does (spark.session, argv[1] the optional master), print as JSON its web UI URL and every
TCP address this process and its children (the driver's JVM) listen on, then stop it."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from pathlib import Path

from spark import session


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().rsplit(") ", 1)[1].split()[1] == str(pid):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    return inodes


def _address(hex_address: str) -> str:
    """/proc/net/tcp's `0100007F:1F90` (host byte order, per 32-bit word) as an address."""
    host, _, port = hex_address.partition(":")
    raw = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port, 16)}"


def listening(pids: list[int]) -> list[str]:
    inodes = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1]))
    return sorted(found)


def main() -> None:
    spark = session("loopback-check", *sys.argv[1:2])
    try:
        ours = [os.getpid(), *_children(os.getpid())]
        print(json.dumps({"ui": spark.sparkContext.uiWebUrl, "listening": listening(ours)}))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
