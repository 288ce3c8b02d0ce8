"""What answers a prepared request (the ``Backend`` of ``deploy/openai/serving.py``): the
Serve application's engine replicas (``cluster``), one in-process engine (``engine``),
both running each choice as an engine request (``choices``), and external
OpenAI-compatible workers (``workers``)."""
