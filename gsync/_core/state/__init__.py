"""What a session keeps and restores: replicas, the state after a failure, random generators, checkpoint files."""
