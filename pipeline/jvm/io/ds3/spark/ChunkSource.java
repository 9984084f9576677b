package io.ds3.spark;

// The ds3 chunk reader for Spark (issue 16): the sealed history of streams as columnar batches,
// decoded in the JVM. Planning stays in Python (pipeline/jvm.py: descriptors, forks, retention,
// bounds, presigned URLs); it hands this source a plan, one JSON option, and each task reads its
// chunk objects (one GET or file read each, the next one's running while this one is decoded)
// and exposes them as column vectors over the object's bytes (ChunkBatch). Python data sources
// cross a process boundary per batch and cost ~2x the bytes' speed before any decoding
// (docs/bench.md, "Where the limit is"); this one does not.
//
// The plan: {"partitions": [{"items": [item, ...]}, ...]}, an item being
//   {"source": "https://presigned-get" | "file:///path", "size": object bytes,
//    "chunk": id, "start": first position, "cap": last position (a fork's cut),
//    "lo": first wanted position, "hi": end of wanted positions or -1,
//    "start_offset": offset of `start`, "end_offset": offset of `cap`,
//    "stream": name, "bucket": name or null, "content_type": type, "json": bool, "text": bool}

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.ArrayList;
import java.util.EnumSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.connector.read.SupportsPushDownFilters;
import org.apache.spark.sql.connector.read.SupportsPushDownRequiredColumns;
import org.apache.spark.sql.sources.DataSourceRegister;
import org.apache.spark.sql.sources.EqualTo;
import org.apache.spark.sql.sources.Filter;
import org.apache.spark.sql.sources.GreaterThan;
import org.apache.spark.sql.sources.GreaterThanOrEqual;
import org.apache.spark.sql.sources.LessThan;
import org.apache.spark.sql.sources.LessThanOrEqual;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

public final class ChunkSource implements TableProvider, DataSourceRegister {
  public static final String SCHEMA_DDL =
      "stream string, offset string, next_offset string, message binary, value string, "
          + "content_type string, chunk long, position long, bucket string, sealed_at timestamp";

  @Override
  public String shortName() {
    return "ds3chunks";
  }

  @Override
  public StructType inferSchema(CaseInsensitiveStringMap options) {
    return StructType.fromDDL(SCHEMA_DDL);
  }

  @Override
  public boolean supportsExternalMetadata() {
    return true; // a projection given with .schema(...)
  }

  @Override
  public Table getTable(StructType schema, Transform[] partitioning, Map<String, String> properties) {
    StructType full = StructType.fromDDL(SCHEMA_DDL);
    for (var field : schema.fields()) {
      int at = full.getFieldIndex(field.name()).getOrElse(() -> -1);
      if (at < 0 || !full.fields()[at].dataType().equals(field.dataType())) {
        throw new IllegalArgumentException(
            "ds3 chunk reader: no column " + field.name() + " " + field.dataType().simpleString()
                + " in ds3 rows (" + SCHEMA_DDL + ")");
      }
    }
    String plan = properties.get("plan");
    if (plan == null) {
      throw new IllegalArgumentException("ds3 chunk reader: the option 'plan' is missing (pipeline/jvm.py makes it)");
    }
    return new ChunkTable(schema, parse(plan));
  }

  static List<ChunkItem[]> parse(String plan) {
    try {
      JsonNode root = new ObjectMapper().readTree(plan);
      List<ChunkItem[]> out = new ArrayList<>();
      for (JsonNode p : root.get("partitions")) {
        JsonNode items = p.get("items");
        ChunkItem[] group = new ChunkItem[items.size()];
        for (int i = 0; i < group.length; i++) {
          group[i] = ChunkItem.of(items.get(i));
        }
        out.add(group);
      }
      return out;
    } catch (IOException e) {
      throw new UncheckedIOException("ds3 chunk reader: the plan is not valid JSON", e);
    }
  }

  static final class ChunkTable implements Table, SupportsRead {
    private final StructType schema;
    private final List<ChunkItem[]> partitions;

    ChunkTable(StructType schema, List<ChunkItem[]> partitions) {
      this.schema = schema;
      this.partitions = partitions;
    }

    @Override
    public String name() {
      return "ds3";
    }

    @Override
    public StructType schema() {
      return schema;
    }

    @Override
    public Set<TableCapability> capabilities() {
      return EnumSet.of(TableCapability.BATCH_READ);
    }

    @Override
    public ScanBuilder newScanBuilder(CaseInsensitiveStringMap options) {
      return new ChunkScanBuilder(schema, partitions);
    }
  }

  /** Only the columns a query uses are built; offset bounds skip whole chunks. */
  static final class ChunkScanBuilder implements ScanBuilder, SupportsPushDownRequiredColumns,
      SupportsPushDownFilters {
    private StructType schema;
    private final List<ChunkItem[]> partitions;
    private final OffsetRange range = new OffsetRange();
    private Filter[] pushed = new Filter[0];

    ChunkScanBuilder(StructType schema, List<ChunkItem[]> partitions) {
      this.schema = schema;
      this.partitions = partitions;
    }

    @Override
    public void pruneColumns(StructType required) {
      schema = required;
    }

    @Override
    public Filter[] pushFilters(Filter[] filters) {
      // Spark still applies every filter to the rows: pruning only has to be safe, not exact.
      List<Filter> used = new ArrayList<>();
      for (Filter f : filters) {
        if (range.narrow(f)) {
          used.add(f);
        }
      }
      pushed = used.toArray(new Filter[0]);
      return filters;
    }

    @Override
    public Filter[] pushedFilters() {
      return pushed;
    }

    @Override
    public Scan build() {
      List<InputPartition> parts = new ArrayList<>();
      for (ChunkItem[] group : partitions) {
        List<ChunkItem> kept = new ArrayList<>();
        for (ChunkItem item : group) {
          if (range.mayHold(item)) {
            kept.add(item);
          }
        }
        if (!kept.isEmpty()) {
          parts.add(new ChunkPartition(kept.toArray(new ChunkItem[0])));
        }
      }
      return new ChunkScan(schema, parts.toArray(new InputPartition[0]));
    }
  }

  static final class ChunkScan implements Scan, Batch {
    private final StructType schema;
    private final InputPartition[] partitions;

    ChunkScan(StructType schema, InputPartition[] partitions) {
      this.schema = schema;
      this.partitions = partitions;
    }

    @Override
    public StructType readSchema() {
      return schema;
    }

    @Override
    public String description() {
      return "ds3 chunks (" + partitions.length + " partitions)";
    }

    @Override
    public Batch toBatch() {
      return this;
    }

    @Override
    public InputPartition[] planInputPartitions() {
      return partitions;
    }

    @Override
    public PartitionReaderFactory createReaderFactory() {
      return new ChunkReaderFactory(schema);
    }
  }

  /** Offset bounds from filters on `offset` (offsets sort as strings in stream order). */
  static final class OffsetRange {
    String lo;
    boolean loOpen;
    String hi;
    boolean hiClosed;

    boolean narrow(Filter f) {
      String attr;
      Object value;
      if (f instanceof GreaterThan g) {
        attr = g.attribute();
        value = g.value();
      } else if (f instanceof GreaterThanOrEqual g) {
        attr = g.attribute();
        value = g.value();
      } else if (f instanceof LessThan l) {
        attr = l.attribute();
        value = l.value();
      } else if (f instanceof LessThanOrEqual l) {
        attr = l.attribute();
        value = l.value();
      } else if (f instanceof EqualTo e) {
        attr = e.attribute();
        value = e.value();
      } else {
        return false;
      }
      if (!"offset".equals(attr) || !(value instanceof String v)) {
        return false;
      }
      boolean lower = f instanceof GreaterThan || f instanceof GreaterThanOrEqual || f instanceof EqualTo;
      boolean upper = f instanceof LessThan || f instanceof LessThanOrEqual || f instanceof EqualTo;
      if (lower) {
        boolean open = f instanceof GreaterThan;
        int c = lo == null ? 1 : v.compareTo(lo);
        if (c > 0 || (c == 0 && open)) {
          lo = v;
          loOpen = open;
        }
      }
      if (upper) {
        boolean closed = !(f instanceof LessThan);
        int c = hi == null ? -1 : v.compareTo(hi);
        if (c < 0 || (c == 0 && !closed)) {
          hi = v;
          hiClosed = closed;
        }
      }
      return true;
    }

    /** Whether a row of the item may pass: its offsets lie in [start_offset, end_offset]. */
    boolean mayHold(ChunkItem item) {
      if (lo != null && item.endOffset.compareTo(lo) <= 0) {
        return false;
      }
      if (hi == null) {
        return true;
      }
      int c = item.startOffset.compareTo(hi);
      return c < 0 || (c == 0 && hiClosed);
    }
  }
}
