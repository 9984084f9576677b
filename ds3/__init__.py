"""ds3: Durable Streams with history in S3-compatible object storage."""

__version__ = "0.1.0"
