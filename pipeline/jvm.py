"""Reading sealed history at the speed of the bytes: the JVM chunk reader (issue 16).

    from pipeline.jvm import load
    df = load(spark, {"store": "s3://bucket/ds3", "stream": "orders"})

`load` takes the `ds3` data source's read options and answers the same rows (same schema, same
bytes, same order within a partition), but the chunks are read and decoded inside Spark's JVM
(pipeline/jvm/io/ds3/spark: column vectors over each chunk object's bytes, built from its
record index) instead of in Python workers, whose every batch crosses a process boundary
(docs/bench.md, "Where the limit is"). Spark is told which columns a query uses, and offset
filters (`offset >= ...`) skip whole chunks.

Planning stays here (pipeline/catalog.py: descriptors, forks, retention, bounds): the plan, one
JSON option, names each chunk object by a presigned GET URL (valid `presign_seconds`: executors
need no store credentials) or a file:// path (a local store: every executor must see it at the
same path). So the DataFrame reads the chunks sealed when `load` was called; call it again to
see newer ones. Reads that include the unsealed tail (`include_tail`) and sessions without the
jar fall back to `spark.read.format("ds3")`.

The jar is compiled from the sources next to this module on first use (`javac`, which a JDK
has; no build tool) into a cache keyed by their hash; `pipeline.session.spark_session` puts it
on `spark.jars`, which also ships it to a cluster's executors.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from pipeline import rows
from pipeline.options import ReadOptions
from pipeline.source import ChunkGroup, DS3BatchReader, batch_options
from shared import protocol

log = logging.getLogger(__name__)

SOURCES: Final = Path(__file__).parent / "jvm"
CLASS: Final = "io.ds3.spark.ChunkSource"
PRESIGN_SECONDS: Final = 3600
_SERVICES: Final = "META-INF/services/org.apache.spark.sql.sources.DataSourceRegister"


def _cache_dir() -> Path:
    base = os.environ.get("DS3_JVM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ds3", "jvm")
    return Path(base)


def _spark_jars() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "jars"


@functools.lru_cache(maxsize=4)
def _fingerprint(sources: Path) -> str:
    """A hash of the Java sources and pyspark's version, read once per process (every `load`
    asks for the jar's path)."""
    import pyspark

    h = hashlib.sha256(pyspark.__version__.encode())
    for src in sorted(sources.rglob("*.java")):
        h.update(str(src.relative_to(sources)).encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:16]


def jar(build: bool = True) -> Path | None:
    """The chunk reader's jar, compiled on first use; None where it cannot be (no javac: a JRE
    only; or it does not compile against this pyspark's jars: logged). Concurrent builders each write their own temp file and rename it into place."""
    path = _cache_dir() / f"ds3-spark-{_fingerprint(SOURCES)}.jar"
    if path.exists() or not build:
        return path if path.exists() else None
    javac = shutil.which("javac")
    if javac is None:
        log.warning("no javac on PATH: the JVM chunk reader is off (reads take the Python data source)")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ds3-jvm-") as tmp:
        classes = Path(tmp) / "classes"
        sources = [str(s) for s in sorted(SOURCES.rglob("*.java"))]
        cmd = [javac, "--release", "17", "-nowarn", "-cp", str(_spark_jars() / "*"), "-d", str(classes), *sources]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:  # (another Spark's API, say): reads take the Python data source
            log.warning("compiling the JVM chunk reader failed; reads take the Python data source:\n%s",
                        done.stderr[-4000:])
            return None
        staged = Path(tmp) / "ds3-spark.jar"
        with zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: ds3\n\n")
            z.writestr(_SERVICES, CLASS + "\n")
            for f in sorted(classes.rglob("*.class")):
                z.write(f, str(f.relative_to(classes)))
        fd, part = tempfile.mkstemp(dir=path.parent, prefix=".ds3-spark-", suffix=".jar")
        try:  # temp file, fsync, rename: a crash never leaves a torn jar under the final name
            os.fchmod(fd, 0o644)  # (mkstemp's 0600 would hide it from other users of the cache)
            with os.fdopen(fd, "wb") as out:
                out.write(staged.read_bytes())
                out.flush()
                os.fsync(out.fileno())
            os.replace(part, path)
        except BaseException:
            Path(part).unlink(missing_ok=True)
            raise
    return path


def on_session(spark: Any) -> bool:
    """Whether the session's JVM was started with the chunk reader's jar."""
    path = jar(build=False)
    try:
        listed = spark.sparkContext.getConf().get("spark.jars", "") or ""
    except Exception:  # (a Spark Connect session has no SparkContext here: not ours to load jars into)
        return False
    return path is not None and str(path) in listed.split(",")


def plan(opts: ReadOptions, presign_seconds: int = PRESIGN_SECONDS) -> str:
    """The chunk reader's plan (ChunkSource.java draws it) for a read of sealed history."""
    parts = []
    for part in DS3BatchReader(opts).partitions():
        assert isinstance(part, ChunkGroup), part  # (no tail: include_tail reads take the Python path)
        parts.append({"items": [{
            "source": opts.store.locate(ref.key, presign_seconds), "size": ref.object_size,
            "chunk": ref.chunk, "start": ref.start, "cap": ref.end, "lo": target.lo,
            "hi": -1 if target.hi is None else target.hi,
            "start_offset": ref.start_offset, "end_offset": ref.end_offset,
            "stream": target.stream, "bucket": target.bucket, "content_type": target.content_type,
            "json": protocol.is_json(target.content_type), "text": rows.has_text(target.content_type),
        } for target, ref in part.items]})
    return json.dumps({"partitions": parts}, separators=(",", ":"))


def load(spark: Any, options: Mapping[str, str], schema: str | None = None, *,
         presign_seconds: int = PRESIGN_SECONDS) -> Any:
    """A DataFrame of the `ds3` rows the read `options` select (the data source's options), with
    the columns of `schema` when given (a projection, as `.schema(...)` on the data source):
    through the JVM chunk reader where the session has it, else the Python data source."""
    opts = batch_options(options)
    if opts.include_tail or not on_session(spark):
        if not opts.include_tail:
            log.info("the session has no JVM chunk reader jar (spark.jars): reading with the Python data source")
        reader = spark.read.format("ds3").options(**options)
    else:
        reader = spark.read.format(CLASS).option("plan", plan(opts, presign_seconds))
    if schema is not None:
        reader = reader.schema(schema)
    return reader.load()
