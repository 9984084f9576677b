"""Stateless reader: serves sealed chunks from object storage (issue 3)."""
