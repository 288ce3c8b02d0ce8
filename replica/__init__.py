"""The replica engine. Kept free of torch imports so the router can import block_hash."""
