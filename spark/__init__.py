"""Batch jobs over sdv-fanout exports (never the live LMDB): the GC plan, the fleet and campaign reports.

This module holds what the jobs share: the export layout, the session, the task type of a request id,
and small-file I/O through
the Hadoop FileSystem API, so every path may be a plain local path or any Hadoop URI (file://,
s3a://, hdfs://). Only the driver runs this code; executors run DataFrame operations alone.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as sf

EXPORT_FORMAT = "sdv-fanout-export"
#: The export format versions the jobs read (storage/export.FORMAT_VERSION): 2 added the lifecycle
#: columns below, 3 the rows' `high_priority`; a version-1 export reads as one without expiries,
#: awaited answers or responses, and one before 3 as one without high-priority rows.
EXPORT_FORMAT_VERSIONS = (1, 2, 3)

#: The export's tables (storage/lmdb/export.py), read with these schemas rather than inferred ones. A column
#: an older export lacks reads as null (Parquet with a given schema), then as EXPORT_DEFAULTS says.
EXPORT_SCHEMAS = {
    "rows": "vin string, request_id string, ts_ms long, sha1 binary, size long, expires_at_ms long, "
    "await_response boolean, high_priority boolean",
    "blobs": "sha1 binary, created_ms long, touched_ms long, size long",
    "aliases": "data_id string, sha1 binary, ts_ms long",
    # sha1 as lower-case hex in the two tables below (rows and blobs keep the raw 20 bytes).
    "outcomes": "vin string, request_id string, sha1 string, outcome string, ended_ms long, stored_ms long, "
    "attempts long, response binary, response_bytes long, sent_ms long",
    "generations": "request_id string, sha1 string, first_ms long, last_ms long, total long, pending long, "
    "delivered long, superseded long, cancelled long, expired long, failed long, responded long",
    # The policy and its abort as JSON text (storage/export_format.POLICIES_SCHEMA).
    "policies": "request_id string, policy string, set_ms long, aborted string",
}
#: Columns whose null in an older export means something else than null: no answer was awaited,
#: none responded, not high priority. (`expires_at_ms`, `response` and `response_bytes` are null for
#: "none" in version 2 too.)
EXPORT_DEFAULTS: dict[str, dict[str, Any]] = {
    "rows": {"await_response": False, "high_priority": False},
    "generations": {"responded": 0},
}

#: request_id `task_<type>_<n>`: <type> may contain `_`; <n> is the last `_`-separated part.
TASK_TYPE_RE = r"^task_(.+)_[^_]+$"
#: The task type of every request id without a `task_<type>_<n>` shape.
OTHER = "other"

_UNITS_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000, "": 1_000}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([dhms]?)\s*$")


class ExportError(ValueError):
    """The export is missing, of another format, or incomplete."""


def parse_duration_ms(text: str) -> int:
    """`7d`, `1h`, `30m`, `45s` or plain seconds (`90`, `1.5`) → milliseconds."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"bad duration {text!r}: use e.g. 7d, 1h, 30m, 45s or plain seconds")
    return round(float(m.group(1)) * _UNITS_MS[m.group(2)])


#: A local run's driver (master local[...]): loopback only and no web UI, so nothing of a job run
#: on a workstation or CI machine is reachable from the network. A cluster submission keeps its own.
LOCAL_CONF = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
}


def submitted_master() -> str | None:
    """The master spark-submit (or PYSPARK_SUBMIT_ARGS) gave the driver's JVM, started here if it
    is not yet; None when none was given (Spark then runs local[*])."""
    from pyspark import SparkContext

    SparkContext._ensure_initialized()
    jvm = SparkContext._jvm
    if jvm is None:  # started by _ensure_initialized
        return None
    value = jvm.java.lang.System.getProperty("spark.master")
    return str(value) if value else None


def session(app_name: str, master: str | None = None) -> SparkSession:
    """The job's session: `master` if given, else what spark-submit configured, else local[*]; a
    local one with LOCAL_CONF."""
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    if (master or submitted_master() or "local[*]").startswith("local"):
        for key, value in LOCAL_CONF.items():
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
    # spark-submit without --master and `python -m` both default to local[*]; say so in the log.
    print(f"{app_name}: master {spark.sparkContext.master}", file=sys.stderr, flush=True)
    return spark


def child(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def _path(spark: SparkSession, uri: str) -> tuple[Any, Any]:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    path = jvm.org.apache.hadoop.fs.Path(uri)
    return path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), path


def qualify(spark: SparkSession, uri: str) -> str:
    """The absolute URI of `uri` on its file system (`/x` → `file:///x` locally, hdfs://nn/x on HDFS)."""
    fs, path = _path(spark, uri)
    text = str(fs.makeQualified(path).toString())
    return "file:///" + text[len("file:/") :].lstrip("/") if text.startswith("file:/") else text


def exists(spark: SparkSession, uri: str) -> bool:
    fs, path = _path(spark, uri)
    return bool(fs.exists(path))


def read_bytes(spark: SparkSession, uri: str) -> bytes:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    fs, path = _path(spark, uri)
    stream = fs.open(path)
    try:
        return bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def delete(spark: SparkSession, uri: str) -> None:
    fs, path = _path(spark, uri)
    fs.delete(path, False)


def write_bytes(spark: SparkSession, uri: str, data: bytes) -> None:
    """Write one real file at `uri`, replacing it; it appears complete or not at all.

    Written beside it under a `_`-prefixed name (which Spark and pyarrow readers skip), then
    renamed; a fresh FileSystem instance without checksums, so no `.crc` files are left behind.
    """
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    path = jvm.org.apache.hadoop.fs.Path(uri)
    tmp = jvm.org.apache.hadoop.fs.Path(path.getParent(), "_" + path.getName() + ".tmp")
    fs = jvm.org.apache.hadoop.fs.FileSystem.newInstance(path.toUri(), conf)
    try:
        fs.setWriteChecksum(False)
        stream = fs.create(tmp, True)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()
        fs.delete(path, False)
        if not fs.rename(tmp, path):
            raise OSError(f"could not rename {tmp.toString()} to {uri}")
    finally:
        fs.close()


def write_json(spark: SparkSession, uri: str, doc: dict[str, Any]) -> None:
    write_bytes(spark, uri, (json.dumps(doc, indent=2) + "\n").encode())


def read_manifest(spark: SparkSession, export_uri: str) -> dict[str, Any]:
    """The export's manifest.json, checked for format and version (it is written last: no manifest, no export)."""
    uri = child(export_uri, "manifest.json")
    if not exists(spark, uri):
        raise ExportError(f"{export_uri}: no manifest.json (not an export, or the export did not finish)")
    manifest: dict[str, Any] = json.loads(read_bytes(spark, uri))
    if manifest.get("format") != EXPORT_FORMAT or manifest.get("format_version") not in EXPORT_FORMAT_VERSIONS:
        raise ExportError(
            f"{export_uri}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}, "
            f"this job reads {EXPORT_FORMAT!r} versions {', '.join(map(str, EXPORT_FORMAT_VERSIONS))}"
        )
    if not isinstance(manifest.get("snapshot_ms"), int):
        raise ExportError(f"{export_uri}: manifest.json has no integer snapshot_ms")
    return manifest


def read_table(spark: SparkSession, export_uri: str, table: str) -> DataFrame:
    """One export table with its schema; the columns an older export lacks take EXPORT_DEFAULTS."""
    df = spark.read.schema(EXPORT_SCHEMAS[table]).parquet(child(export_uri, table))
    for column, value in EXPORT_DEFAULTS.get(table, {}).items():
        df = df.withColumn(column, sf.coalesce(sf.col(column), sf.lit(value)))
    return df


def require_tables(manifest: dict[str, Any], export_uri: str, *tables: str) -> None:
    """Refuse an export made before `tables` existed (the format version stays when a table is added)."""
    missing = [t for t in tables if t not in manifest.get("counts", {})]
    if missing:
        raise ExportError(
            f"{export_uri}: no {', '.join(missing)} table in the manifest (an export from an older sdv-fanout)"
        )


def task_type(request_id: str | Column) -> Column:
    """The `<type>` of `task_<type>_<n>`, or OTHER: how every report groups request ids."""
    extracted = sf.regexp_extract(request_id, TASK_TYPE_RE, 1)
    return sf.when(extracted == "", OTHER).otherwise(extracted)


def check_count(manifest: dict[str, Any], table: str, df: DataFrame) -> int:
    """Count `df` (Parquet footers only) and compare with the manifest: a lost part file must not pass."""
    n = df.count()
    expected = manifest.get("counts", {}).get(table)
    if expected is not None and expected != n:
        raise ExportError(f"export table {table!r} has {n} rows, its manifest says {expected}: export incomplete")
    return n
