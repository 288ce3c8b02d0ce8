"""Everything Ray: replica actors, router actor, Serve request router, client."""
