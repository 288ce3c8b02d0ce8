"""The OpenAI-compatible HTTP layer, Ray-free: the FastAPI app (``api``), the protocol and
request fields, ``OpenAIServing`` (validation, templates, tokenization, the ``Backend``
contract), tool calling (``tools/``), reasoning, fan-out, answer shaping (``answers/``),
and the Responses and Anthropic Messages APIs (``responses/``, ``messages/``), each a
translation onto the chat path. Hosts and backends live beside it in ``deploy/``."""
