"""The committed generated modules match proto/ (run `make proto` after editing a .proto)."""

from __future__ import annotations

from pathlib import Path

from exhook_server import protogen


def test_generated_modules_match_proto_sources(tmp_path: Path) -> None:
    """Regenerating from proto/ gives byte-identical files to the committed ones."""
    generated = protogen.generate(tmp_path)
    assert {p.name for p in generated} == {
        "admin_pb2.py",
        "admin_pb2.pyi",
        "exhook_v2_pb2.py",
        "exhook_v2_pb2.pyi",
        "exhook_v3_pb2.py",
        "exhook_v3_pb2.pyi",
    }
    committed = protogen.ROOT / protogen.PACKAGE_DIR
    stale = [p.name for p in generated if p.read_bytes() != (committed / p.name).read_bytes()]
    assert not stale, f"stale generated modules, run `make proto`: {stale}"


def test_v2_and_v3_differ_only_in_package_and_v3_additions() -> None:
    """Both protos declare the same messages; v3 only adds fields, never renumbers."""
    from exhook_server._proto import exhook_v2_pb2 as v2
    from exhook_server._proto import exhook_v3_pb2 as v3

    assert set(v2.DESCRIPTOR.message_types_by_name) == set(v3.DESCRIPTOR.message_types_by_name)
    for name, m2 in v2.DESCRIPTOR.message_types_by_name.items():
        m3 = v3.DESCRIPTOR.message_types_by_name[name]
        for f in m2.fields:
            g = m3.fields_by_name[f.name]
            assert (g.number, g.type, g.is_repeated) == (f.number, f.type, f.is_repeated), f"{name}.{f.name}"
