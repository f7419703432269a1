"""Regenerate exhook_server/_proto from proto/*.proto with grpc_tools (a dev dependency).

The generated modules are committed so that installing the server needs no
protoc; tests/unit/test_proto_fresh.py regenerates into a temporary directory
and fails when the committed copies differ.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE_DIR = "exhook_server/_proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi")


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under out_root/exhook_server/_proto; returns their paths."""
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    # The virtual include path makes the generated imports package-qualified.
    args = [
        "protoc",
        f"-I{PACKAGE_DIR}={PROTO_DIR}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        *(f"{PACKAGE_DIR}/{p.name}" for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted(p for p in (out_root / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, ROOT / PACKAGE_DIR / path.name)
            print(f"wrote {PACKAGE_DIR}/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
