"""ds3 data pipeline on PySpark: a `ds3` data source (batch and streaming), a writer, and jobs."""
