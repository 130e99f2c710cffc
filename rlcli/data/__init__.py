"""Rollout data: the record schema and its validation, file readers, packing into micro-batches."""
