"""Policy simulator: N simulated replicas (real KV cache manager + scheduler, a cost
model instead of a model) behind the real Router. ``kvroute bench sim``."""
