"""OpenAI answers shaped from finished choices (``bodies``) and from the merged delta
stream (``chunks``), with logprobs as vLLM reports them (``logprobs``)."""
