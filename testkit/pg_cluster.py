"""Throwaway PostgreSQL clusters for tests and benchmarks: initdb, pg_ctl, a synchronous standby, promote.

`PgCluster.create()` runs `initdb` into a fresh temp dir and starts the server on a free port of
127.0.0.1 only, its unix socket in that dir, fsync and synchronous_commit ON (durability is what the
tests check). PostgreSQL refuses to run as root: as root, every server-side command runs as the
dedicated system user `PG_OS_USER` (created once with `useradd --system`), which owns the temp dir.
`stop()` always leaves no process and no dir behind, whatever state the server is in. Each dir
names the process that made it (`owner`): a cluster whose owner died without stopping it (a
killed pytest) is stopped and deleted by the next `create()` on the machine (`reap_orphans`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from testkit.emqx_sim import LOOPBACK, free_port
from testkit.harness import poll

#: The OS user the servers run as when the tests run as root (a system user without a home or shell).
PG_OS_USER = "sdv-pgtest"
#: Overrides where initdb, pg_ctl, pg_basebackup and psql are looked for.
BINDIR_ENV = "SDV_TEST_PG_BINDIR"
SUPERUSER = "postgres"  #: bootstrap superuser: administration and replication connections
APP_USER = "sdv"  #: what the product connects as: owns its database, no superuser rights
APP_DB = "sdv"
#: Debian installs each major version here; /usr/local/bin may hold symlinks to one of them.
DEBIAN_PG_ROOT = Path("/usr/lib/postgresql")

_live: set[PgCluster] = set()
#: In a cluster's dir: "<pid> <start time>" of the process that made it.
OWNER_FILE = "owner"


def find_bindir() -> Path | None:
    """The directory holding PostgreSQL's server binaries: `$SDV_TEST_PG_BINDIR`, else Debian's
    newest /usr/lib/postgresql/<major>/bin, else wherever `pg_ctl` on PATH really lives."""
    candidates: list[Path] = []
    if os.environ.get(BINDIR_ENV):
        candidates.append(Path(os.environ[BINDIR_ENV]))
    majors = [p for p in DEBIAN_PG_ROOT.glob("*/bin") if p.parent.name.isdigit()]
    candidates += sorted(majors, key=lambda p: int(p.parent.name), reverse=True)
    if on_path := shutil.which("pg_ctl"):
        candidates.append(Path(on_path).resolve().parent)
    for c in candidates:
        if all((c / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres", "pg_basebackup", "psql")):
            return c
    return None


def _os_user() -> tuple[int, int] | None:
    """(uid, gid) the server must run as: None when we are not root, else PG_OS_USER's (created now)."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(PG_OS_USER)
    except KeyError:
        # A concurrent session may create it first: its failure then is harmless, getpwnam decides.
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
             "--shell", "/usr/sbin/nologin", "--comment", "sdv-fanout throwaway PostgreSQL", PG_OS_USER],
            capture_output=True, check=False,
        )  # fmt: skip
        pw = pwd.getpwnam(PG_OS_USER)
    return pw.pw_uid, pw.pw_gid


def _reachable_by_others(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


def _clean_env() -> dict[str, str]:
    """Our environment without PG* variables (a PGDATA or PGPORT of the machine must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


class PgError(RuntimeError):
    """A PostgreSQL command failed; the message carries its output and the server log's tail."""


class PgCluster:
    """One PostgreSQL server in a temp dir of its own: a primary from `create()`, or a standby from
    `basebackup_standby()`. `dsn` is the product's connection (role and database `sdv`, no password:
    trust on loopback), `admin_dsn` the superuser's."""

    def __init__(self, bindir: Path, *, name: str, settings: dict[str, str] | None = None) -> None:
        self.bindir = bindir
        self.name = name
        self.settings = dict(settings or {})
        self.port = 0
        self.pid = 0  #: the postmaster's, once started
        self.standby_of: PgCluster | None = None
        self._user = _os_user()
        base = Path(tempfile.gettempdir())
        if self._user is not None and not _reachable_by_others(base):
            base = Path("/tmp")  # the server's user must be able to walk down to its dir
        self.dir = Path(tempfile.mkdtemp(prefix=f"sdv-pg-{name}-", dir=base))
        if self._user is not None:
            os.chown(self.dir, *self._user)
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "server.log"
        (self.dir / OWNER_FILE).write_text(f"{os.getpid()} {process_start(os.getpid())}\n")
        _live.add(self)

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def create(cls, *, name: str = "primary", settings: dict[str, str] | None = None) -> PgCluster:
        """initdb + start a new primary with the `sdv` role and database; raises PgError (after
        cleaning up) if that fails, or when no PostgreSQL binaries are installed."""
        bindir = find_bindir()
        if bindir is None:
            raise PgError(f"no PostgreSQL binaries (initdb, pg_ctl) found: install postgresql-15 or set {BINDIR_ENV}")
        reap_orphans()
        cluster = cls(bindir, name=name, settings=settings)
        try:
            # --no-sync: initdb's files are not flushed (a second saved per cluster), which only a
            # machine crash before the first checkpoint could notice; the tests kill processes, and
            # every commit they make is WAL-fsynced as in production (fsync, synchronous_commit on).
            cluster._server_cmd(
                "initdb", "-D", str(cluster.data_dir), "-U", SUPERUSER, "--auth=trust",
                "--encoding=UTF8", "--locale=C", "--no-instructions", "--no-sync",
            )  # fmt: skip
            cluster._start()
            cluster.psql(f"CREATE ROLE {APP_USER} LOGIN", f"CREATE DATABASE {APP_DB} OWNER {APP_USER}")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def basebackup_standby(self, name: str = "standby1", *, synchronous: bool = True) -> PgCluster:
        """A streaming standby of this primary (`pg_basebackup -R`), started; with `synchronous`
        this primary then acknowledges a commit only once the standby has flushed it (so a promoted
        standby holds every acknowledged commit). Stop the standby before this primary goes on
        writing without it: a synchronous primary waits for it forever."""
        standby = PgCluster(self.bindir, name=name, settings=self.settings)
        try:
            conninfo = f"host={LOOPBACK} port={self.port} user={SUPERUSER} application_name={name}"
            standby._server_cmd(
                "pg_basebackup", "-D", str(standby.data_dir), "-R", "-X", "stream", "--checkpoint=fast",
                "--no-sync", "-d", conninfo,  # --no-sync: as initdb's in create()
            )  # fmt: skip
            standby.standby_of = self
            standby._start()  # the copied postgresql.conf names our port: _start appends its own
            if synchronous:
                self.psql(f"ALTER SYSTEM SET synchronous_standby_names = '\"{name}\"'", "SELECT pg_reload_conf()")
                sync = f"SELECT 1 FROM pg_stat_replication WHERE application_name = '{name}' AND sync_state = 'sync'"
                poll(lambda: self.psql(sync).strip() == "1", timeout_s=30, interval_s=0.05)
        except BaseException:
            standby.stop()
            raise
        return standby

    # -- use ---------------------------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        return self.dsn_for(APP_DB)

    @property
    def admin_dsn(self) -> str:
        return self.dsn_for("postgres", SUPERUSER)

    def dsn_for(self, database: str, user: str = APP_USER) -> str:
        return f"postgresql://{user}@{LOOPBACK}:{self.port}/{database}"

    def new_database(self, name: str, template: str = "template1") -> str:
        """A fresh database owned by `sdv` (isolation within a shared cluster), a copy of `template`
        (by default PostgreSQL's empty one; no one may be connected to it); its DSN."""
        for n in (name, template):
            if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", n):
                raise ValueError(f"database name {n!r}: lower-case letters, digits and _ only")
        self.psql(f"CREATE DATABASE {name} TEMPLATE {template} OWNER {APP_USER}")
        return self.dsn_for(name)

    def psql(self, *sql: str, database: str = "postgres", timeout_s: float = 30.0) -> str:
        """Run SQL commands as the superuser through psql on loopback, each in its own transaction
        (CREATE DATABASE and ALTER SYSTEM refuse a transaction block); unaligned, tuples only output."""
        argv = [str(self.bindir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                "-h", LOOPBACK, "-p", str(self.port), "-U", SUPERUSER, "-d", database]  # fmt: skip
        for command in sql:
            argv += ["-c", command]
        done = subprocess.run(argv, capture_output=True, text=True, env=_clean_env(), timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise PgError(f"{self.name}: psql failed ({done.returncode}): {'; '.join(sql)}\n{done.stderr}")
        return done.stdout

    def is_in_recovery(self) -> bool:
        return self.psql("SELECT pg_is_in_recovery()").strip() == "t"

    def promote(self, timeout_s: float = 30.0) -> None:
        """Make this standby a primary (`pg_ctl promote`, waiting until it accepts writes)."""
        self._server_cmd("pg_ctl", "promote", "-D", str(self.data_dir), "-w", "-t", str(int(timeout_s)))
        poll(lambda: not self.is_in_recovery(), timeout_s=timeout_s, interval_s=0.05)
        self.standby_of = None

    def kill(self) -> None:
        """kill -9 the postmaster and every process of it: a crash, for failover tests."""
        pids = self._processes()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        poll(lambda: not any(pid_alive(p) for p in pids), timeout_s=10, interval_s=0.02)

    def stop(self) -> None:
        """Stop the server and delete its dir; idempotent. The data goes with the dir, so the stop is
        `-m immediate` (no shutdown checkpoint to write first), SIGKILL if that fails."""
        if self.pid and pid_alive(self.pid):
            with contextlib.suppress(PgError, subprocess.TimeoutExpired):
                self._server_cmd("pg_ctl", "stop", "-D", str(self.data_dir), "-m", "immediate", "-w", "-t", "15")
            if self._processes():
                self.kill()
        self.pid = 0
        shutil.rmtree(self.dir, ignore_errors=True)
        _live.discard(self)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> PgCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"PgCluster({self.name!r}, port={self.port}, pid={self.pid}, dir={str(self.dir)!r})"

    # -- internals ---------------------------------------------------------------------------------

    def _server_cmd(self, tool: str, *args: str, timeout_s: float = 120.0) -> str:
        """Run a server-side binary as the server's OS user (files it creates are then that user's)."""
        argv: Sequence[str] = [str(self.bindir / tool), *args]
        as_user: dict[str, object] = {}
        if self._user is not None:
            as_user = {"user": self._user[0], "group": self._user[1], "extra_groups": []}
        done = subprocess.run(
            argv, capture_output=True, text=True, env=_clean_env(), cwd=self.dir, stdin=subprocess.DEVNULL,
            timeout=timeout_s, check=False, **as_user,  # type: ignore[call-overload]
        )  # fmt: skip
        if done.returncode != 0:
            raise PgError(
                f"{self.name}: {' '.join(argv)} failed ({done.returncode}):\n{done.stdout}{done.stderr}\n"
                f"server log:\n{self.log_tail()}"
            )
        return str(done.stdout)

    def _start(self, attempts: int = 3) -> None:
        """Configure a free port (appended: later lines win over the copied ones of a standby) and
        start; a port taken between choosing and binding is retried with another."""
        for attempt in range(attempts):
            self.port = free_port()
            conf = {
                "listen_addresses": f"'{LOOPBACK}'",
                "port": str(self.port),
                "unix_socket_directories": f"'{self.dir}'",  # never the machine's /var/run/postgresql
                # Durability is what the tests check: both are PostgreSQL's defaults, pinned here.
                "fsync": "on",
                "synchronous_commit": "on",
                "logging_collector": "off",
                **self.settings,
            }
            with open(self.data_dir / "postgresql.conf", "a") as f:  # the file stays the server user's
                f.write(f"\n# sdv-fanout tests ({self.name}, attempt {attempt + 1})\n")
                f.writelines(f"{k} = {v}\n" for k, v in conf.items())
            try:
                self._server_cmd(
                    "pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self.log_path), "-w", "-t", "60"
                )
            except PgError:
                if attempt + 1 < attempts and "could not bind" in self.log_tail():
                    continue
                raise
            self.pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
            return

    def _processes(self) -> list[int]:
        """The postmaster and its children still alive (children die with it, but not at once)."""
        if not self.pid or not pid_alive(self.pid):
            return []
        out = [self.pid]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == self.pid:
                    out.append(int(entry.name))
        return out


def multi_host_dsn(*clusters: PgCluster, database: str = APP_DB, user: str = APP_USER) -> str:
    """The product's store_url naming every cluster, as for a primary and its standbys: the driver
    tries them in order and keeps the first that accepts writes (`target_session_attrs=read-write`),
    so after a promote the same URL finds the new primary."""
    hosts = ",".join(f"{LOOPBACK}:{c.port}" for c in clusters)
    return f"postgresql://{user}@{hosts}/{database}?target_session_attrs=read-write"


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def process_start(pid: int) -> str:
    """The process's start time (clock ticks since boot; "" when it is gone): with the pid, a
    name that a reused pid does not take over."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _gone(pid: int) -> bool:
    return not pid_alive(pid)


def reap_orphans(base: Path | None = None) -> list[Path]:
    """Stop and delete the clusters under `base` (the temp dir) whose owner process is gone; the
    dirs removed. A dir without an owner file (being made, or of an older testkit) is left alone."""
    reaped = []
    for d in sorted((base or Path(tempfile.gettempdir())).glob("sdv-pg-*")):
        try:
            pid, start = (d / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        if process_start(int(pid)) == start:
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            postmaster = int((d / "data" / "postmaster.pid").read_text().split()[0])
            # Only a postmaster of this dir's data (the pid may have been reused since).
            if str(d) in Path(f"/proc/{postmaster}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(postmaster, signal.SIGQUIT)  # immediate shutdown: its children go with it
                poll(functools.partial(_gone, postmaster), timeout_s=10, interval_s=0.02)
        shutil.rmtree(d, ignore_errors=True)
        reaped.append(d)
    return reaped


@atexit.register
def _stop_all() -> None:
    """A safety net for an interrupted run: no server outlives the Python process that started it."""
    for cluster in list(_live):
        with contextlib.suppress(Exception):
            cluster.stop()
