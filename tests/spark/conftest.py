"""One local Spark session (local[1], loopback only, no UI) shared by the Spark job tests."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest


def _need_java() -> None:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail(
            "the Spark jobs need a Java runtime (Java 17): install one, e.g. apt-get install openjdk-17-jre-headless"
        )


#: Settings for every JVM the tests start: bind to loopback only, no UI, no progress bars, fast startup.
LOOPBACK_CONF = {
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # Short-lived JVMs: C1 only starts and warms up faster; nothing here runs long enough to need C2.
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
}


@pytest.fixture
def spark_env() -> dict[str, str]:
    """Environment for a `python -m spark.…` subprocess: the same loopback-only, UI-less, local[1] JVM."""
    _need_java()
    confs = " ".join(f"--conf {k}={v}" for k, v in LOOPBACK_CONF.items() if k != "spark.driver.extraJavaOptions")
    args = f"--master local[1] {confs} --driver-java-options -XX:TieredStopAtLevel=1 pyspark-shell"
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_SUBMIT_ARGS": args}


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local[1] SparkSession with 2 shuffle partitions, stopped when the test session ends."""
    _need_java()
    from pyspark.sql import SparkSession

    saved = os.environ.get("SPARK_LOCAL_IP")
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # read by the JVM launched below; restored after
    try:
        builder = (
            SparkSession.builder.master("local[1]")
            .appName("sdv-fanout-tests")
            .config("spark.sql.shuffle.partitions", "2")
            # The tests' exports are a few hundred rows: compiling generated code for each stage
            # and re-planning (AQE) cost more than running the stage interpreted (the report
            # tests, 55 s -> 37 s on the loaded 2-core VM). Results are the same either way.
            .config("spark.sql.codegen.wholeStage", "false")
            .config("spark.sql.codegen.factoryMode", "NO_CODEGEN")
            .config("spark.sql.adaptive.enabled", "false")
            .config("spark.default.parallelism", "1")
            .config("spark.sql.warehouse.dir", str(tmp_path_factory.mktemp("spark-warehouse")))
        )
        for key, value in LOOPBACK_CONF.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
    finally:
        if saved is None:
            os.environ.pop("SPARK_LOCAL_IP", None)
        else:
            os.environ["SPARK_LOCAL_IP"] = saved
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
