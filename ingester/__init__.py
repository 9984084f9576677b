"""The ingester: owns writes, keeps the LMDB write-ahead log, serves the live tail."""
