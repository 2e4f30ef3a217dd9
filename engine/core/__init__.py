"""Memory management and scheduling: block pool, KV cache manager, scheduler."""
