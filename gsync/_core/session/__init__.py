"""A session's insides: the core that steps and fails, the service task that owns its task group, its peers."""
