"""Anthropic's Messages API as a translation onto the chat path: the request
(``request``), the routes (``api``) and the answer shaped back (``answer``)."""
