"""`sdv-fanout serve` refuses what it cannot start with in one line naming the setting, exit 2,
before any server process exists: a data_dir that is not a writable directory, and a listen,
admin_listen or metrics_listen address something else holds, with one process or several."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.harness import BIN

#: An existing directory even root cannot create files in (sysfs), for the unwritable case.
UNWRITABLE = Path("/sys/kernel")


@pytest.fixture
def taken() -> Iterator[str]:
    """A loopback address another process's listening socket holds (with SO_REUSEPORT, as a
    gRPC server or a group of ours holds its port)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def serve(tmp_path: Path, processes: int, **settings: str) -> list[str]:
    """Run `serve` with free loopback ports but for `settings`; its exit code must be 2: the
    lines it wrote (stdout and stderr)."""
    env = {
        **os.environ,
        "SDV_FANOUT_LISTEN": "127.0.0.1:0",
        "SDV_FANOUT_ADMIN_LISTEN": "127.0.0.1:0",
        "SDV_FANOUT_METRICS_LISTEN": "127.0.0.1:0",
        "SDV_FANOUT_MQTT_URL": "",
        "SDV_FANOUT_DATA_DIR": str(tmp_path / "lmdb"),
        "SDV_FANOUT_PROCESSES": str(processes),
        **{"SDV_FANOUT_" + k.upper(): v for k, v in settings.items()},
    }
    out = subprocess.run([str(BIN / "sdv-fanout"), "serve"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    return (out.stdout + out.stderr).splitlines()


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("setting", ["listen", "admin_listen", "metrics_listen"])
def test_a_taken_address_is_one_line_naming_its_setting(
    tmp_path: Path, taken: str, setting: str, processes: int
) -> None:
    """No gRPC C-core line, no child started (they would log), no traceback: one line."""
    assert serve(tmp_path, processes, **{setting: taken}) == [f"sdv-fanout: {setting} {taken}: address already in use"]


@pytest.mark.parametrize("processes", [1, 2])
def test_a_data_dir_that_is_a_file_is_one_line_naming_data_dir(tmp_path: Path, processes: int) -> None:
    (tmp_path / "file").write_text("not a directory")
    [line] = serve(tmp_path, processes, data_dir=str(tmp_path / "file"))
    assert line == f"sdv-fanout: data_dir {tmp_path / 'file'}: not a directory"
    [line] = serve(tmp_path, processes, data_dir=str(tmp_path / "file" / "lmdb"))
    assert line.startswith(f"sdv-fanout: data_dir {tmp_path / 'file' / 'lmdb'}: cannot create it: ")


@pytest.mark.parametrize("processes", [1, 2])
def test_an_unwritable_data_dir_is_one_line_naming_data_dir(tmp_path: Path, processes: int) -> None:
    try:
        (UNWRITABLE / "probe").open("w").close()
    except OSError:
        pass
    else:  # pragma: no cover - depends on the machine
        pytest.skip(f"{UNWRITABLE} is writable here")
    [line] = serve(tmp_path, processes, data_dir=str(UNWRITABLE))
    assert line.startswith(f"sdv-fanout: data_dir {UNWRITABLE}: not writable: ")


@pytest.mark.parametrize("processes", [1, 2])
def test_a_tls_file_it_cannot_read_is_one_line_naming_its_setting(tmp_path: Path, processes: int) -> None:
    """Before, the children read the TLS files after the fork: each logged a failure, exit 1."""
    missing = tmp_path / "missing.pem"
    (tmp_path / "key.pem").write_text("not read")
    [line] = serve(tmp_path, processes, tls_cert_file=str(missing), tls_key_file=str(tmp_path / "key.pem"))
    assert line == f"sdv-fanout: tls_cert_file {missing}: cannot read it: no such file or directory"


def test_a_data_dir_another_server_holds_is_one_line_naming_data_dir(tmp_path: Path) -> None:
    import fcntl

    (tmp_path / "lmdb").mkdir()
    with open(tmp_path / "lmdb" / "server.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        [line] = serve(tmp_path, 1)
    assert line == f"sdv-fanout: data_dir {tmp_path / 'lmdb'}: another sdv-fanout server is running on it"
