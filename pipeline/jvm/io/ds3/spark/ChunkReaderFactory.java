package io.ds3.spark;

import java.io.IOException;
import java.io.InputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.net.URL;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayDeque;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/** Executor side: a task reads its chunk objects in order, one ahead, and decodes each. */
final class ChunkReaderFactory implements PartitionReaderFactory {
  private static final long serialVersionUID = 1L;
  private static final int ATTEMPTS = 4; // a GET that fails (I/O, 5xx) is retried, backing off

  private final StructType schema;

  ChunkReaderFactory(StructType schema) {
    this.schema = schema;
  }

  @Override
  public boolean supportColumnarReads(InputPartition partition) {
    return true;
  }

  @Override
  public PartitionReader<InternalRow> createReader(InputPartition partition) {
    throw new UnsupportedOperationException("ds3 chunk reader: columnar reads only");
  }

  @Override
  public PartitionReader<ColumnarBatch> createColumnarReader(InputPartition partition) {
    return new Reader(((ChunkPartition) partition).items, schema);
  }

  static byte[] fetch(ChunkItem item) throws IOException {
    byte[] obj = item.source.startsWith("file:")
        ? Files.readAllBytes(Path.of(URI.create(item.source))) : get(item);
    if (obj.length != item.size) {
      throw new IOException(item.where() + ": " + obj.length + " bytes, the catalog listed " + item.size);
    }
    return obj;
  }

  /** GET a presigned URL into an array of the object's size (the catalog knows it): one copy
   * from the socket, none after. */
  private static byte[] get(ChunkItem item) throws IOException {
    URL url = URI.create(item.source).toURL();
    IOException last = null;
    for (int attempt = 0; attempt < ATTEMPTS; attempt++) {
      if (attempt > 0) {
        try {
          Thread.sleep(100L << attempt);
        } catch (InterruptedException e) {
          Thread.currentThread().interrupt();
          throw new IOException("GET " + item.where() + ": interrupted", e);
        }
      }
      HttpURLConnection conn = (HttpURLConnection) url.openConnection();
      conn.setConnectTimeout(10_000);
      conn.setReadTimeout(300_000);
      try {
        int status = conn.getResponseCode();
        if (status == 200) {
          try (InputStream in = conn.getInputStream()) {
            byte[] obj = new byte[Math.toIntExact(item.size)];
            int got = in.readNBytes(obj, 0, obj.length);
            if (got != obj.length || in.read() != -1) {
              throw new IOException(item.where() + ": the body is not the " + item.size
                  + " bytes the catalog listed");
            }
            return obj;
          }
        }
        InputStream err = conn.getErrorStream();
        byte[] body = err == null ? new byte[0] : err.readNBytes(300);
        if (err != null) {
          err.close();
        }
        last = new IOException("GET " + item.where() + ": HTTP " + status + " "
            + new String(body, StandardCharsets.UTF_8));
        if (status < 500) {
          throw last; // 403 (an expired URL), 404: retrying cannot help
        }
      } catch (IOException e) {
        if (e == last) {
          throw e;
        }
        last = e; // a refused or cut connection: again
        conn.disconnect();
      }
    }
    throw last;
  }

  /** The task's batches: one per chunk object (none for a chunk with no wanted message). The
   * next AHEAD objects are fetched (each on a thread of its own) while this one is decoded and
   * consumed: a GET from S3 runs at about 100 MB/s per connection, and Spark's consumption of
   * a chunk is faster than that. A task holds at most AHEAD + 1 objects. */
  static final class Reader implements PartitionReader<ColumnarBatch> {
    static final int AHEAD = 2;
    private final ChunkItem[] items;
    private final StructType schema;
    private final ExecutorService pool;
    private final ArrayDeque<Future<byte[]>> ahead = new ArrayDeque<>();
    private int submitted;
    private int next;
    private ColumnarBatch batch;

    Reader(ChunkItem[] items, StructType schema) {
      this.items = items;
      this.schema = schema;
      this.pool = Executors.newFixedThreadPool(AHEAD, r -> {
        Thread t = new Thread(r, "ds3-prefetch");
        t.setDaemon(true);
        return t;
      });
      fill();
    }

    private void fill() {
      while (submitted < items.length && ahead.size() < AHEAD) {
        ChunkItem item = items[submitted++];
        ahead.add(pool.submit(() -> fetch(item)));
      }
    }

    @Override
    public boolean next() throws IOException {
      while (next < items.length) {
        int i = next++;
        byte[] obj;
        try {
          obj = ahead.poll().get();
        } catch (InterruptedException e) {
          Thread.currentThread().interrupt();
          throw new IOException("ds3 chunk reader: interrupted", e);
        } catch (ExecutionException e) {
          Throwable cause = e.getCause();
          throw cause instanceof IOException io ? io : new IOException(cause);
        }
        fill();
        try {
          batch = ChunkBatch.decode(obj, items[i], schema);
        } catch (ChunkBatch.FormatError e) {
          throw new IOException(items[i].where() + ": " + e.getMessage(), e);
        }
        if (batch.numRows() > 0) {
          return true;
        }
      }
      return false;
    }

    @Override
    public ColumnarBatch get() {
      return batch;
    }

    @Override
    public void close() {
      pool.shutdownNow(); // (also when Spark stops early, e.g. for a LIMIT)
    }
  }
}
