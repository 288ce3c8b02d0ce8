"""Global block-hash directory and routing policies (pure Python, no torch)."""
