"""Starting a SparkSession for ds3 jobs and tests: the Python workers must run this very
interpreter (so `pipeline` and `shared` import on executors) and, locally, Spark must bind to
127.0.0.1. The `ds3` data source is registered on the session, and the JVM chunk reader's jar
(pipeline/jvm.py) is on its `spark.jars`."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession


def spark_session(master: str = "local[*]", app_name: str = "ds3-pipeline",
                  conf: dict[str, str] | None = None) -> SparkSession:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.master(master).appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.python.worker.reuse", "true")
    )
    conf = dict(conf or {})
    from pipeline import jvm

    reader_jar = jvm.jar()  # the JVM chunk reader (pipeline/jvm.py), shipped to executors too
    if reader_jar is not None:
        conf["spark.jars"] = ",".join(filter(None, [conf.get("spark.jars"), str(reader_jar)]))
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    from pipeline.source import register

    register(spark)
    return spark
