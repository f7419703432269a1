"""The README stays true to the code it documents."""

from __future__ import annotations

import dataclasses
import json
import re

from exhook_server.config import Config
from exhook_server.errors import Reason
from tests.harness import ROOT

README = (ROOT / "README.md").read_text()


def test_readme_config_table_lists_every_setting_with_its_default() -> None:
    """Each Config field has a row in the README table whose default matches the code."""
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)`", README, flags=re.M))
    for field in dataclasses.fields(Config):
        assert field.name in rows, f"README lacks setting {field.name}"
        default = getattr(Config(), field.name)
        shown = default if isinstance(default, str) else json.dumps(Config().as_dict()[field.name])
        assert rows[field.name] == shown, f"{field.name}: README says {rows[field.name]}, code {shown}"


def test_readme_lists_every_reason_code() -> None:
    """Each rejection reason code is documented."""
    for reason in Reason:
        assert f"| `{reason.value}` |" in README, reason.value
