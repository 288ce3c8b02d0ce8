"""Serving over HTTP: the Ray-free OpenAI layer (``openai/``), the backends that answer
its prepared requests (``backends/``), and the hosts that serve them (the Serve
application ``app``, the single-engine server ``replica_server``, the CLI ``cli``)."""
