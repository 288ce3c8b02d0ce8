"""HTTP API, Serve app builder and the CLI."""
