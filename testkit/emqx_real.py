"""Real EMQX brokers for tests, benchmarks and `make demo`: find a release, unpack it once, run it.

`find_release` looks in `EMQX_HOME` (one unpacked release: then it is the only broker), else for the
tarballs of `RELEASES` in `SDV_FANOUT_EMQX_RELEASES`, `<repo>/../shared/emqx`, `/work/shared/emqx`,
unpacking each once into `$XDG_CACHE_HOME/sdv-fanout/emqx/<stem>` (under a lock, renamed into place
when complete). `EmqxBroker` runs one node on free loopback ports with its own node name, cookie,
data and log dirs under `workdir`; `stop()` leaves no process of it behind. `Platform` is the batch
publisher, a real MQTT 5 client of such a broker (testkit/mqtt.py; its vehicles: testkit/vehicle.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import structlog

from testkit.emqx_sim import LOOPBACK, free_port, free_ports
from testkit.harness import ROOT, poll
from testkit.mqtt import Client

log = structlog.get_logger("sdv_fanout.testkit.emqx_real")

#: EMQX version -> the tarball built for these tests (see /work/shared/emqx/README.md).
RELEASES: dict[str, str] = {
    "5.1.6": "emqx-5.1.6-debian12-amd64.tar.xz",
    "5.8.9": "emqx-5.8.9-debian12-amd64.tar.xz",
    "5.9.1": "emqx-e5.9.1-debian12-amd64.tar.xz",
}
#: EMQX version -> the ExHook package it calls (v2 up to 5.8, v3 from 5.9).
EXHOOK_PROTOCOL: dict[str, str] = {"5.1.6": "v2", "5.8.9": "v2", "5.9.1": "v3"}

DEFAULT_RELEASE_DIRS = (ROOT.parent / "shared" / "emqx", Path("/work/shared/emqx"))
ADMIN = {"username": "admin", "password": "public"}  # the release's bootstrap dashboard user

# ekka (EMQX's distribution) derives a node's listen port from its name: 4370 + the trailing number.
_DIST_BASE_PORT = 4370
_DIST_MAX_OFFSET = 60000
_PR_SET_PDEATHSIG = 1
#: What EMQX prints on its console once every application has started ("EMQX 5.8.9 is running now!").
_BOOTED = "is running now!"
_counter = itertools.count()


class EmqxError(RuntimeError):
    """A broker could not be started, stopped or talked to."""


class EmqxUnavailable(EmqxError):
    """No release for the version, or a runtime library it links to is missing."""


class EmqxApiError(EmqxError):
    """The REST API answered an HTTP error; `status` and `body` say which."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body}")
        self.status = status
        self.body = body


# ---------------------------------------------------------------------------------------------
# finding and unpacking releases
# ---------------------------------------------------------------------------------------------


def exhook_protocol(version: str) -> str:
    """The ExHook package a version calls: `EXHOOK_PROTOCOL`, else v3 from 5.9 on, v2 before."""
    if version in EXHOOK_PROTOCOL:
        return EXHOOK_PROTOCOL[version]
    major, minor = (int(p) for p in re.findall(r"\d+", version)[:2])
    return "v3" if (major, minor) >= (5, 9) else "v2"


def release_version(release: Path) -> str | None:
    """The EMQX version of an unpacked release (`releases/start_erl.data`: "<erts> <version>")."""
    try:
        fields = (release / "releases" / "start_erl.data").read_text().split()
    except OSError:
        fields = []
    if len(fields) >= 2:
        return fields[1].lstrip("ev")
    with contextlib.suppress(OSError):
        for d in sorted((release / "releases").iterdir()):
            if (d / "start.boot").is_file():
                return d.name.lstrip("ev")
    return None


def release_dirs() -> list[Path]:
    """Where tarballs are looked for: `SDV_FANOUT_EMQX_RELEASES` alone if set, else the defaults."""
    env = os.environ.get("SDV_FANOUT_EMQX_RELEASES")
    if env:
        return [Path(env)]
    out: list[Path] = []
    for d in DEFAULT_RELEASE_DIRS:
        if d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def where_looked() -> str:
    """One line saying where releases were looked for (for skip and error messages)."""
    home = os.environ.get("EMQX_HOME")
    if home:
        return f"EMQX_HOME={home} (version {release_version(Path(home))})"
    dirs = ", ".join(str(d) for d in release_dirs())
    return f"EMQX_HOME unset; no {' / '.join(RELEASES.values())} in {dirs}"


def _home() -> Path | None:
    home = os.environ.get("EMQX_HOME")
    return Path(home) if home else None


def _tarball(version: str) -> Path | None:
    name = RELEASES.get(version)
    if name is None:
        return None
    for d in release_dirs():
        if (d / name).is_file():
            return d / name
    return None


def available_versions() -> list[str]:
    """Versions `find_release` can provide (without unpacking anything)."""
    home = _home()
    if home is not None:
        v = release_version(home) if (home / "bin" / "emqx").is_file() else None
        return [v] if v else []
    return [v for v in RELEASES if _tarball(v) is not None]


def find_release(version: str) -> Path | None:
    """The unpacked release directory (with bin/emqx) for `version`, or None when unavailable."""
    home = _home()
    if home is not None:
        ok = (home / "bin" / "emqx").is_file() and release_version(home) == version
        return home if ok else None
    tarball = _tarball(version)
    return _unpacked(tarball) if tarball is not None else None


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/sdv-fanout/emqx` (or ~/.cache/...): unpacked releases, one dir per tarball."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sdv-fanout" / "emqx"


def _stem(tarball: Path) -> str:
    return re.sub(r"\.(tar\.xz|tar\.gz|tgz|tar)$", "", tarball.name)


def _unpacked(tarball: Path) -> Path:
    """Unpack once; concurrent sessions wait on a lock, and nobody ever sees a half-unpacked dir."""
    root = cache_dir()
    stem = _stem(tarball)
    target = root / stem
    if (target / "bin" / "emqx").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "bin" / "emqx").is_file():
            return target  # another session unpacked it while we waited
        for stale in root.glob(f".{stem}.*"):  # left by a session killed while unpacking
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{stem}.", dir=root))
        try:
            started = time.monotonic()
            done = subprocess.run(["tar", "-xf", str(tarball), "-C", str(tmp)], capture_output=True, check=False)
            if done.returncode != 0:
                raise EmqxUnavailable(f"cannot unpack {tarball}: {done.stderr.decode(errors='replace').strip()}")
            tops = [p for p in tmp.iterdir() if (p / "bin" / "emqx").is_file()]
            if len(tops) != 1:
                raise EmqxUnavailable(f"{tarball} does not hold one release directory with bin/emqx")
            os.rename(tops[0], target)
            log.info("emqx_unpacked", tarball=str(tarball), to=str(target), seconds=time.monotonic() - started)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


_missing_cache: dict[Path, list[str]] = {}


def missing_libraries(release: Path) -> list[str]:
    """Shared libraries the release's NIFs link to but the dynamic loader cannot find."""
    if release in _missing_cache:
        return _missing_cache[release]
    missing: set[str] = set()
    for so in sorted(release.glob("lib/*/priv/**/*.so")):
        out = subprocess.run(["ldd", str(so)], capture_output=True, text=True, check=False).stdout
        missing.update(m.group(1) for m in re.finditer(r"^\s*(\S+) => not found", out, re.M))
    _missing_cache[release] = sorted(missing)
    return _missing_cache[release]


# ---------------------------------------------------------------------------------------------
# one broker
# ---------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies, so a crashed session leaves no broker."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _mqtt_accepts(port: int) -> bool:
    """An MQTT 3.1.1 CONNECT on a raw socket gets a CONNACK "accepted" (then DISCONNECT)."""
    clientid = f"probe-{secrets.token_hex(4)}".encode()
    var = b"\x00\x04MQTT\x04\x02\x00\x0a" + len(clientid).to_bytes(2, "big") + clientid
    try:
        with socket.create_connection((LOOPBACK, port), timeout=2) as s:
            s.sendall(bytes([0x10, len(var)]) + var)
            ack = s.recv(4)
            s.sendall(b"\xe0\x00")
    except OSError:
        return False
    return ack == b"\x20\x02\x00\x00"


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of pid, from /proc."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(d.name))
        starts[int(d.name)] = fields[19]
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append((p, starts[p]))
        todo.extend(children.get(p, []))
    return out


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _free_dist_offset(taken: set[int]) -> int:
    """A node-name number N whose distribution port 4370 + N is free on loopback and not `taken`."""
    for _ in range(100):
        port = free_port()
        if _DIST_BASE_PORT < port < _DIST_BASE_PORT + _DIST_MAX_OFFSET and port not in taken:
            return port - _DIST_BASE_PORT
    raise EmqxError("no free port for the Erlang distribution")


class EmqxBroker:
    """One real EMQX node on 127.0.0.1: MQTT over TCP and the REST API, nothing else listening.

    Ports, node name, cookie, data and log dirs are chosen in the constructor and kept across
    `restart()`, so clients reconnect to the same port and the ExHook registration (kept in the
    data dir) survives. `env` adds or overrides EMQX settings (`EMQX_MQTT__MAX_INFLIGHT=1`, ...).
    The node runs in the foreground as our child and dies with this process, whatever kills it.
    """

    host = LOOPBACK

    def __init__(self, version: str, workdir: Path, *, env: dict[str, str] | None = None) -> None:
        release = find_release(version)
        if release is None:
            raise EmqxUnavailable(f"no EMQX {version}: {where_looked()}")
        self.release = release
        self.version = version
        self.protocol = exhook_protocol(version)
        self.mqtt_port, self.api_port, self.rpc_port = free_ports(3)
        offset = _free_dist_offset({self.mqtt_port, self.api_port, self.rpc_port})
        # ekka takes the distribution port from the name's trailing number; the rest makes it unique.
        self.node_name = f"emqx-{os.getpid()}-{next(_counter)}-{offset}@{LOOPBACK}"
        self.dir = Path(workdir) / self.node_name.split("@")[0]
        self.data_dir = self.dir / "data"
        self.log_dir = self.dir / "log"
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._console: IO[bytes] | None = None
        self._token: str | None = None
        self._children: list[tuple[int, str]] = []
        self._cookie = secrets.token_hex(16)
        self._console_offset = 0
        self._launched = 0.0

    # -- process -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """`mqtt://127.0.0.1:<mqtt_port>`."""
        return f"mqtt://{self.host}:{self.mqtt_port}"

    @property
    def running(self) -> bool:
        """True while the node's process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def environment(self) -> dict[str, str]:
        """The environment `bin/emqx` runs with: our ports, names and dirs, then `env`.

        The caller's own EMQX_* variables are left out (one could move a port or the data dir);
        settings for the node go through `env`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMQX_")}
        env.update(
            EMQX_NODE__NAME=self.node_name,
            EMQX_NODE__COOKIE=self._cookie,
            EMQX_NODE__DATA_DIR=str(self.data_dir),
            EMQX_LOG_DIR=str(self.log_dir),
            EMQX_LOG__TO="file",
            EMQX_LISTENERS__TCP__DEFAULT__BIND=f"{LOOPBACK}:{self.mqtt_port}",
            EMQX_LISTENERS__SSL__DEFAULT__ENABLE="false",
            EMQX_LISTENERS__WS__DEFAULT__ENABLE="false",
            EMQX_LISTENERS__WSS__DEFAULT__ENABLE="false",
            EMQX_DASHBOARD__LISTENERS__HTTP__BIND=f"{LOOPBACK}:{self.api_port}",
            EMQX_RPC__PORT_DISCOVERY="manual",
            EMQX_RPC__TCP_SERVER_PORT=str(self.rpc_port),
            # Distribution and gen_rpc would listen on every interface; 5.1 has no
            # rpc.listen_address, but command-line application flags win over its config.
            ERL_AFLAGS="-kernel inet_dist_use_interface {127,0,0,1} -gen_rpc socket_ip {127,0,0,1}",
            # `bin/emqx` commands find their node in `ps -ef`, whose lines `ps` cuts at $COLUMNS
            # (pytest sets 80): `bin/emqx stop` then missed the node. Empty = no limit.
            COLUMNS="",
        )
        env.update(self.extra_env)
        return env

    def start(self, timeout_s: float = 90) -> EmqxBroker:
        """Start the node; return once MQTT accepts a connection and the REST login works."""
        if self.running:
            return self
        return self.launch().wait_started(timeout_s)

    def launch(self) -> EmqxBroker:
        """Start the node's process and return at once (`wait_started` waits for the boot): several
        brokers then boot side by side. Call it from the thread that outlives the broker: the node
        dies with the thread that started it (PR_SET_PDEATHSIG)."""
        missing = missing_libraries(self.release)
        if missing:
            raise EmqxUnavailable(
                f"EMQX {self.version} in {self.release} needs {', '.join(missing)}, which is not installed: "
                "apt-get install librocksdb7.8 (scripts/bootstrap does it)"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._keep_earlier_logs()
        console = self.log_dir / "console.log"
        self._console_offset = console.stat().st_size if console.exists() else 0
        self._console = open(console, "ab")  # noqa: SIM115 - closed in stop()
        self._launched = time.monotonic()
        self.proc = subprocess.Popen(
            [str(self.release / "bin" / "emqx"), "foreground"],
            cwd=self.release,
            env=self.environment(),
            stdin=subprocess.DEVNULL,
            stdout=self._console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal is for pytest, not for the broker
            preexec_fn=_die_with_parent,
        )
        self._token = None
        return self

    def wait_started(self, timeout_s: float = 90) -> EmqxBroker:
        """After `launch`: return once the node says it runs, MQTT accepts and the REST login works."""
        console = self.log_dir / "console.log"
        offset = self._console_offset

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise EmqxError(f"EMQX {self.version} exited with {self.proc.returncode}:\n{self.log_tail()}")
            # Listeners open before the boot ends: until EMQX says it is running, authorization can
            # still be its boot-time deny-all (a SUBSCRIBE then gets "not authorized").
            return _BOOTED in _read_from(console, offset) and _mqtt_accepts(self.mqtt_port) and self._login(quiet=True)

        try:
            poll(ready, timeout_s=timeout_s, interval_s=0.1)
        except AssertionError:
            self.stop()
            raise EmqxError(f"EMQX {self.version} not ready within {timeout_s} s:\n{self.log_tail()}") from None
        except BaseException:
            self.stop()
            raise
        assert self.proc is not None
        self._children = _descendants(self.proc.pid)
        log.info(
            "emqx_started",
            version=self.version,
            node=self.node_name,
            mqtt_port=self.mqtt_port,
            api_port=self.api_port,
            seconds=round(time.monotonic() - self._launched, 2),
        )
        return self

    def stop(self, timeout_s: float = 30) -> None:
        """A graceful stop (SIGTERM), then SIGKILL whatever of ours is left; always waits for the
        processes.

        EMQX answers SIGTERM with its graceful shutdown (`received_terminate_signal`: listeners
        closed, applications stopped), the one `bin/emqx stop` asks for, without the second Erlang
        node `bin/emqx stop` boots to ask it. Only the node's own descendants are killed. There is
        no epmd to spare or to clean up: EMQX 5 runs with `-start_epmd false -epmd_module ekka_epmd`
        (ports derive from node names), so the node starts none, and an epmd someone else runs is
        never ours.
        """
        proc, self.proc = self.proc, None
        if proc is not None:
            # Children spawned since start (port programs) are ours too.
            children = {*self._children, *_descendants(proc.pid)} if proc.poll() is None else set(self._children)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout_s)
            for pid, start in children:
                if _start_time(pid) == start:  # still the process we saw, not a reused pid
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        if self._console is not None:
            self._console.close()
            self._console = None
        self._token = None

    def kill(self) -> None:
        """SIGKILL the node and its children (a crash, not a shutdown)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self._children = list({*self._children, *_descendants(proc.pid)})
            proc.kill()
        self.stop()

    def restart(self, timeout_s: float = 90) -> EmqxBroker:
        """Stop and start again on the same ports and data dir (sessions in memory are lost)."""
        self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> EmqxBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- logs ----------------------------------------------------------------------------------

    def _emqx_logs(self) -> list[Path]:
        def generation(p: Path) -> int:
            suffix = p.name.rsplit(".", 1)[1]
            return int(suffix) if suffix.isdigit() else 0

        return sorted(self.log_dir.glob("emqx.log.[0-9]*"), key=generation)

    def _keep_earlier_logs(self) -> None:
        """A new run of the node starts emqx.log.1 afresh: append the last run's to earlier.log."""
        logs = self._emqx_logs()
        if logs:
            with open(self.log_dir / "earlier.log", "ab") as out:
                for f in logs:
                    out.write(f.read_bytes())
                    f.unlink()

    def log_text(self) -> str:
        """Everything the node logged: console output, then emqx.log of earlier runs and this one."""
        if self._console is not None:
            self._console.flush()
        parts = []
        for f in [self.log_dir / "console.log", self.log_dir / "earlier.log", *self._emqx_logs()]:
            with contextlib.suppress(OSError):
                parts.append(f.read_text(errors="replace"))
        return "".join(parts)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of `log_text()`, for error messages."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- REST API ------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any, token: str | None) -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{self.host}:{self.api_port}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def _login(self, quiet: bool = False) -> bool:
        try:
            status, text = self._request("POST", "/api/v5/login", ADMIN, None)
        except OSError:
            if quiet:
                return False
            raise
        if status != 200:
            if quiet:
                return False
            raise EmqxApiError("POST", "/api/v5/login", status, text)
        self._token = json.loads(text)["token"]
        return True

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """Call the REST API (`/exhooks` means `/api/v5/exhooks`); JSON in and out, None if empty."""
        if not path.startswith("/api/"):
            path = "/api/v5" + (path if path.startswith("/") else "/" + path)
        if self._token is None:
            self._login()
        status, text = self._request(method, path, body, self._token)
        if status == 401:  # token of an earlier run of the node
            self._login()
            status, text = self._request(method, path, body, self._token)
        if status >= 400:
            raise EmqxApiError(method, path, status, text)
        return json.loads(text) if text.strip() else None

    def create_api_key(self, name: str, timeout_s: float = 30) -> tuple[str, str]:
        """A new API key (`POST /api/v5/api_key`) for HTTP basic auth: (key, secret).

        `desc` is sent because 5.1.6 and 5.8.9 answer 500 without it; e5.9.1 answers 404 on the
        route for a few seconds after its listener opens, so 404 is retried until `timeout_s`."""
        body = {"name": name, "desc": "sdv-fanout tests", "enable": True}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                made = self.api("POST", "/api_key", body)
                return str(made["api_key"]), str(made["api_secret"])
            except EmqxApiError as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def register_exhook(
        self,
        name: str,
        url: str,
        *,
        pool_size: int = 8,
        request_timeout: str = "5s",
        failed_action: str = "ignore",
        auto_reconnect: str = "2s",
        wait: bool = True,
    ) -> None:
        """Add (or replace) an ExHook server; with `wait`, return once EMQX shows it connected."""
        conf = {
            "name": name,
            "enable": True,
            "url": url,
            "pool_size": pool_size,
            "request_timeout": request_timeout,
            "failed_action": failed_action,
            "auto_reconnect": auto_reconnect,
        }
        try:
            self.api("POST", "/exhooks", conf)
        except EmqxApiError as exc:
            if exc.status != 400 or "exist" not in exc.body.lower():
                raise
            self.api("PUT", f"/exhooks/{name}", conf)
        if wait:
            self.wait_exhook(name)

    def exhook_status(self, name: str) -> list[str]:
        """`node_status[].status` of an ExHook server (e.g. ["connected"])."""
        detail = self.api("GET", f"/exhooks/{name}")
        return [s.get("status", "") for s in detail.get("node_status", [])]

    def wait_exhook(self, name: str, status: str = "connected", timeout_s: float = 30) -> None:
        """Poll until every node shows the ExHook server in `status`."""
        seen: list[list[str]] = []

        def reached() -> bool:
            s = self.exhook_status(name)
            seen.append(s)
            return bool(s) and all(x == status for x in s)

        try:
            poll(reached, timeout_s=timeout_s, interval_s=0.1)
        except AssertionError:
            last = seen[-1] if seen else None
            msg = f"exhook {name} not {status} within {timeout_s} s (last {last}):\n{self.log_tail()}"
            raise EmqxError(msg) from None

    def exhook_hooks(self, name: str) -> Any:
        """GET /exhooks/<name>/hooks: the hooks and topic filters EMQX got from the server."""
        return self.api("GET", f"/exhooks/{name}/hooks")

    def unregister_exhook(self, name: str) -> None:
        """Remove an ExHook server (nothing if it is not there)."""
        try:
            self.api("DELETE", f"/exhooks/{name}")
        except EmqxApiError as exc:
            if exc.status != 404:
                raise


# ---------------------------------------------------------------------------------------------
# the platform: an MQTT client of a real broker
# ---------------------------------------------------------------------------------------------


class Platform(Client):
    """The SDV platform: publishes batches at QoS 1 and waits for each PUBACK (= stored or refused)."""

    def __init__(self, broker: EmqxBroker, clientid: str = "sdv-platform", username: str | None = None) -> None:
        super().__init__(broker, clientid, username=username or "")  # deploy/emqx/acl.conf knows it by username
        self.connect()

    def batch(
        self, vins: list[str], request_id: str, data: str, topic: str = "$SDV-FANOUT", **extra: Any
    ) -> int | None:
        """A seed-format batch `{"ids", "request_id", "data", **extra}`; returns the PUBACK reason code."""
        doc = {"ids": vins, "request_id": request_id, "data": data, **extra}
        return self.publish(topic, json.dumps(doc).encode())

    def cancel(self, request_id: str, vins: list[str] | None = None) -> int | None:
        """`{"request_id", "ids"?}` on `$SDV-FANOUT/cancel`; returns the PUBACK reason code."""
        doc: dict[str, Any] = {"request_id": request_id} | ({"ids": vins} if vins is not None else {})
        return self.publish("$SDV-FANOUT/cancel", json.dumps(doc).encode())

    def data(self, data_id: str, payload: bytes) -> int | None:
        """The plugin format's data message on `$SDV-FANOUT/data/<data_id>`."""
        return self.publish(f"$SDV-FANOUT/data/{data_id}", payload)

    def trigger(self, vins: list[str], request_id: str, data_id: str) -> int | None:
        """The plugin format's trigger on `$SDV-FANOUT/trigger`."""
        doc = {"ids": vins, "request_id": request_id, "data_id": data_id}
        return self.publish("$SDV-FANOUT/trigger", json.dumps(doc).encode())


def file_authorization(acl: Path, *, no_match: str = "deny") -> dict[str, str]:
    """`env` for an EmqxBroker whose only authorization source is the ACL file `acl`, read as it
    is (`authorization.sources = [{type = file, path = ...}]`), with `authorization.no_match`."""
    source = {"type": "file", "enable": True, "path": str(acl)}
    return {"EMQX_AUTHORIZATION__SOURCES": json.dumps([source]), "EMQX_AUTHORIZATION__NO_MATCH": no_match}


def started_emqx(version: str, workdir: Path, **kw: Any) -> EmqxBroker:
    """`EmqxBroker(version, workdir, **kw).start()`, but a boot that fails (a port it was given got
    taken meanwhile by a process beside it) is tried once more on new ports."""
    broker = EmqxBroker(version, workdir, **kw)
    try:
        return broker.start()
    except EmqxUnavailable:
        raise
    except EmqxError:
        broker.kill()
        return EmqxBroker(version, workdir, **kw).start()


@contextlib.contextmanager
def running_emqx(version: str, workdir: Path, **kw: Any) -> Iterator[EmqxBroker]:
    """A `started_emqx`, killed on exit whatever happens: a throwaway broker needs no graceful
    stop (2-3 s per broker on the loaded 2-core VM, against 0.1 s for SIGKILL; the suite stops
    several). Tests of a broker's restart call `stop()` themselves."""
    broker = started_emqx(version, workdir, **kw)
    try:
        yield broker
    finally:
        broker.kill()


__all__ = [
    "EXHOOK_PROTOCOL",
    "RELEASES",
    "EmqxApiError",
    "EmqxBroker",
    "EmqxError",
    "EmqxUnavailable",
    "Platform",
    "available_versions",
    "cache_dir",
    "exhook_protocol",
    "file_authorization",
    "find_release",
    "missing_libraries",
    "release_dirs",
    "release_version",
    "running_emqx",
    "started_emqx",
    "where_looked",
]
