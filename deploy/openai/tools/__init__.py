"""Tool calling: the request's tools and calls as data (``calls``), the parsers of the
formats models are trained on (one module each, chosen in ``parsers``), forced calls
(``forcing``) and the per-request plan (``serving``)."""
