"""Model implementations written against the paged KV cache."""
