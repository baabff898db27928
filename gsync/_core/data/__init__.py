"""Global batches split into per-device shards, and the thread that reads the user's data."""
