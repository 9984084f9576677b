package io.ds3.spark;

import com.fasterxml.jackson.databind.JsonNode;
import java.io.Serializable;

/** One chunk object's part of a read, as planned by pipeline/jvm.py (ChunkSource's plan). */
final class ChunkItem implements Serializable {
  private static final long serialVersionUID = 1L;

  final String source; // presigned https URL, or file:// path
  final long size; // the object's bytes
  final long chunk;
  final long start; // the chunk's first position
  final long cap; // last position of the stream's history in it (a fork's cut)
  final long lo; // first position wanted
  final long hi; // end of the wanted positions; -1: no bound
  final String startOffset;
  final String endOffset;
  final String stream;
  final String bucket; // null: no bucket
  final String contentType;
  final boolean json;
  final boolean text;

  private ChunkItem(JsonNode n) {
    source = n.get("source").asText();
    size = n.get("size").asLong();
    chunk = n.get("chunk").asLong();
    start = n.get("start").asLong();
    cap = n.get("cap").asLong();
    lo = n.get("lo").asLong();
    hi = n.get("hi").asLong();
    startOffset = n.get("start_offset").asText();
    endOffset = n.get("end_offset").asText();
    stream = n.get("stream").asText();
    bucket = n.get("bucket").isNull() ? null : n.get("bucket").asText();
    contentType = n.get("content_type").asText();
    json = n.get("json").asBoolean();
    text = n.get("text").asBoolean();
  }

  static ChunkItem of(JsonNode n) {
    return new ChunkItem(n);
  }

  /** The source without a presigned URL's signature (for error messages). */
  String where() {
    int q = source.indexOf('?');
    return q < 0 ? source : source.substring(0, q);
  }
}
