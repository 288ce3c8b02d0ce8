"""The OpenAI Responses API as a translation onto the chat path: the request
(``request``), the routes (``api``), the answer and its events (``output``, ``stream``)
and where stored responses are kept (``store``)."""
