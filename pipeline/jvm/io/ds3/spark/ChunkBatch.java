package io.ds3.spark;

// A chunk object (shared/chunks.py draws the layout) as a columnar batch of its wanted messages:
//
//   prelude (32 bytes): "DS3CHNK1" | version u32 BE (=1) | header length H u32 BE
//                       | index length I u64 BE (= 9 N) | data length D u64 BE
//   header (H bytes, JSON): {"chunk", "start", "end", "records", "created_at", ...}
//   index (N x 9 bytes): record i's end position u64 BE | flags u8
//   data (D bytes): data byte k is stream position start + k
//
// The columns are views over the object's bytes, built from the index alone: a message's bytes
// are a slice of the data (a JSON message without the ',' it is stored with), `value` the same
// slice as a string (no copy, where it is valid UTF-8; else decoded with replacement, as the
// Python rows are), offsets spelled once per batch into one byte array that `offset` and
// `next_offset` share. Only the columns the query asks for exist. Same rows, byte for byte, as
// pipeline/rows.py (tests/test_pipeline_jvm.py compares them).

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarBatch;
import org.apache.spark.unsafe.types.UTF8String;

final class ChunkBatch {
  static final byte[] MAGIC = "DS3CHNK1".getBytes(StandardCharsets.US_ASCII);
  static final int PRELUDE = 32;
  static final int ENTRY = 9;
  static final int MAX_HEADER = 64 * 1024;
  private static final ObjectMapper JSON = new ObjectMapper();

  /** The bytes are not a valid chunk object, or not the one the plan names. */
  static final class FormatError extends Exception {
    private static final long serialVersionUID = 1L;

    FormatError(String message) {
      super(message);
    }
  }

  private ChunkBatch() {}

  static ColumnarBatch decode(byte[] obj, ChunkItem item, StructType schema) throws FormatError {
    ByteBuffer b = ByteBuffer.wrap(obj); // big-endian
    if (obj.length < PRELUDE || !ByteBuffer.wrap(obj, 0, 8).equals(ByteBuffer.wrap(MAGIC))) {
      throw new FormatError("not a ds3 chunk object (bad magic)");
    }
    int version = b.getInt(8);
    long h = Integer.toUnsignedLong(b.getInt(12));
    long indexLength = b.getLong(16);
    long dataLength = b.getLong(24);
    if (version != 1) {
      throw new FormatError("chunk format version " + version + " (this reader knows 1)");
    }
    if (h > MAX_HEADER || indexLength < 0 || indexLength % ENTRY != 0 || dataLength < 0
        || PRELUDE + h + indexLength + dataLength != obj.length) {
      throw new FormatError("prelude lengths (" + h + ", " + indexLength + ", " + dataLength
          + ") do not add up to the object's " + obj.length + " bytes");
    }
    JsonNode header;
    try {
      header = JSON.readTree(obj, PRELUDE, (int) h);
    } catch (IOException e) {
      throw new FormatError("chunk header is not JSON: " + e.getMessage());
    }
    long chunk = header.path("chunk").asLong(-1);
    long start = header.path("start").asLong(-1);
    long end = header.path("end").asLong(-1);
    int n = (int) (indexLength / ENTRY);
    if (chunk != item.chunk || start != item.start) {
      throw new FormatError("header names chunk " + chunk + " at " + start + ", expected " + item.chunk
          + " at " + item.start);
    }
    if (header.path("records").asLong(-1) != n || end - start != dataLength) {
      throw new FormatError("the header (" + header.path("records") + " records, positions " + start + ".." + end
          + ") disagrees with the index (" + n + " entries) or the data (" + dataLength + " bytes)");
    }
    int indexAt = PRELUDE + (int) h;
    long dataAt = indexAt + indexLength - start; // object byte of stream position p: p + dataAt
    // The wanted records are one run: those starting in [lo, cap) and ending (cut at cap) by hi.
    long[] starts = new long[n];
    long[] ends = new long[n];
    int first = -1;
    int count = 0;
    long prev = start;
    for (int i = 0; i < n; i++) {
      long e = b.getLong(indexAt + i * ENTRY);
      if (e <= prev || e > end) {
        throw new FormatError("index entry " + i + " ends at " + e + ", after " + prev + " (chunk end " + end + ")");
      }
      long cut = Math.min(e, item.cap);
      if (prev < item.cap && prev >= item.lo && (item.hi < 0 || cut <= item.hi)) {
        if (first < 0) {
          first = i;
        }
        starts[count] = prev;
        ends[count] = cut;
        count++;
      }
      prev = e;
    }
    if (n > 0 && prev != end) {
      throw new FormatError("the index ends at " + prev + ", the header at " + end);
    }
    StructField[] fields = schema.fields();
    ColumnVector[] vectors = new ColumnVector[fields.length];
    Offsets spelled = null;
    Messages messages = null;
    for (int c = 0; c < fields.length; c++) {
      switch (fields[c].name()) {
        case "stream" -> vectors[c] = Vectors.constant(fields[c].dataType(), item.stream);
        case "content_type" -> vectors[c] = Vectors.constant(fields[c].dataType(), item.contentType);
        case "bucket" -> vectors[c] = Vectors.constant(fields[c].dataType(), item.bucket);
        case "chunk" -> vectors[c] = Vectors.constant(fields[c].dataType(), item.chunk);
        case "sealed_at" -> vectors[c] = Vectors.constant(fields[c].dataType(),
            (long) (header.path("created_at").asDouble() * 1_000_000));
        case "position" -> vectors[c] = Vectors.longs(fields[c].dataType(), starts);
        case "offset", "next_offset" -> {
          if (spelled == null) {
            spelled = new Offsets(item, starts, ends, count, first == 0);
          }
          vectors[c] = Vectors.offsets(fields[c].dataType(), spelled, fields[c].name().equals("offset") ? 0 : 1);
        }
        case "message", "value" -> {
          if (messages == null) {
            messages = new Messages(obj, starts, ends, count, dataAt, item.json);
          }
          boolean value = fields[c].name().equals("value");
          vectors[c] = value && !item.text ? Vectors.constant(fields[c].dataType(), null)
              : value ? Vectors.strings(fields[c].dataType(), messages) : Vectors.binary(fields[c].dataType(), messages);
        }
        default -> throw new IllegalArgumentException("no column " + fields[c].name() + " in ds3 rows");
      }
    }
    return new ColumnarBatch(vectors, count);
  }

  /** Offsets of the batch's rows, spelled into one array: bound i is the position before row i
   * (bound count: after the last); `offset` is bounds 0..count-1, `next_offset` 1..count. */
  static final class Offsets {
    final byte[] text;
    final int[] at; // bound i is text[at[i], at[i + 1])

    Offsets(ChunkItem item, long[] starts, long[] ends, int count, boolean fromChunkStart) {
      byte[] prefix = (pad(item.chunk) + "_").getBytes(StandardCharsets.US_ASCII);
      at = new int[count + 2];
      byte[] out = new byte[(count + 1) * 33 + 64];
      int w = 0;
      for (int i = 0; i <= count; i++) {
        at[i] = w;
        long position = i < count ? starts[i] : (count > 0 ? ends[count - 1] : item.lo);
        if (i == 0 && fromChunkStart && count > 0) {
          byte[] s = item.startOffset.getBytes(StandardCharsets.US_ASCII); // names the chunk before
          out = ensure(out, w + s.length + 33 * (count + 1));
          System.arraycopy(s, 0, out, w, s.length);
          w += s.length;
          continue;
        }
        out = ensure(out, w + prefix.length + 20);
        System.arraycopy(prefix, 0, out, w, prefix.length);
        w += prefix.length;
        w = digits(out, w, position);
      }
      at[count + 1] = w;
      text = out;
    }

    private static byte[] ensure(byte[] a, int size) {
      return size <= a.length ? a : java.util.Arrays.copyOf(a, Math.max(size, a.length * 2));
    }

    /** `position` in 16 digits (more when it is 10^16 or more, as Python's {:016d} does). */
    private static int digits(byte[] out, int w, long position) {
      if (position >= 10_000_000_000_000_000L) {
        byte[] s = Long.toString(position).getBytes(StandardCharsets.US_ASCII);
        System.arraycopy(s, 0, out, w, s.length);
        return w + s.length;
      }
      for (int k = 15; k >= 0; k--) {
        out[w + k] = (byte) ('0' + position % 10);
        position /= 10;
      }
      return w + 16;
    }

    private static String pad(long v) {
      String s = Long.toString(v);
      return s.length() >= 16 ? s : "0".repeat(16 - s.length()) + s;
    }
  }

  /** The rows' message bytes: row i is obj[from[i], to[i]); JSON messages without their ','. */
  static final class Messages {
    final byte[] obj;
    final int[] from;
    final int[] to;

    Messages(byte[] obj, long[] starts, long[] ends, int count, long dataAt, boolean json) {
      this.obj = obj;
      from = new int[count];
      to = new int[count];
      for (int i = 0; i < count; i++) {
        int a = (int) (starts[i] + dataAt);
        int z = (int) (ends[i] + dataAt);
        if (json && z > a && obj[z - 1] == ',') {
          z--; // (shared/jsonmode.unframe: only a trailing ',' is dropped)
        }
        from[i] = a;
        to[i] = z;
      }
    }

    UTF8String string(int row) {
      int a = from[row];
      int z = to[row];
      if (Utf8.valid(obj, a, z)) {
        return UTF8String.fromBytes(obj, a, z - a); // a view: no copy
      }
      return UTF8String.fromString(new String(obj, a, z - a, StandardCharsets.UTF_8));
    }

    byte[] binary(int row) {
      return java.util.Arrays.copyOfRange(obj, from[row], to[row]);
    }
  }
}
