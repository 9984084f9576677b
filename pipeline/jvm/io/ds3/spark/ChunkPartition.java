package io.ds3.spark;

import org.apache.spark.sql.connector.read.InputPartition;

/** Consecutive chunk objects read by one task. */
final class ChunkPartition implements InputPartition {
  private static final long serialVersionUID = 1L;

  final ChunkItem[] items;

  ChunkPartition(ChunkItem[] items) {
    this.items = items;
  }
}
