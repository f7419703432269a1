"""The README stays true to the code it documents."""

from __future__ import annotations

import dataclasses
import json
import re

from exhook_server.config import Config
from exhook_server.errors import Reason
from testkit.harness import ROOT

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


def test_readme_says_which_hooks_are_registered_and_what_costs_a_call() -> None:
    """The README's hook count and names are hook_specs' (with and without ack_topic_prefix), and
    it does not claim that only message.publish is registered or only batches cost a call."""
    from exhook_server.hooks import hook_specs

    words = {8: "8", 9: "9"}
    default = [name for name, _ in hook_specs(Config())]
    rule_acks = [name for name, _ in hook_specs(Config(ack_topic_prefix="$SDV-FANOUT/acked"))]
    [bullet] = re.findall(r"^- Asks EMQX for .*?(?=^- )", README, flags=re.M | re.S)
    assert bullet.startswith(f"- Asks EMQX for {words[len(default)]} hooks"), bullet
    assert f"{words[len(rule_acks)]} hooks then" in bullet
    assert all(f"`{name}`" in bullet for name in default), bullet
    assert "heartbeat" in bullet and "answer" in bullet
    flat = " ".join(README.split())
    assert "only for `message.publish`" not in flat and "Only message.publish is registered" not in flat


def test_spark_readme_says_where_pyspark_comes_from() -> None:
    """pyspark is pinned in requirements.txt (the test set, not the runtime set), as spark/README says."""
    spark_readme = " ".join((ROOT / "spark" / "README.md").read_text().split())
    pinned = re.search(r"^pyspark==", (ROOT / "requirements.txt").read_text(), flags=re.M)
    assert pinned and "pyspark" not in (ROOT / "requirements-runtime.txt").read_text()
    assert "not in `requirements.txt`" not in spark_readme
    assert "pyspark is pinned in `requirements.txt`" in spark_readme
