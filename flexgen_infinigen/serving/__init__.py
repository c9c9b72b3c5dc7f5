"""The OpenAI-compatible server's parts (the command is :mod:`flexgen_infinigen.serve`):

- :mod:`.requests`: an HTTP body checked into a :class:`~.requests.ServeRequest` (the OpenAI
  Batch format's validation, plus streaming and log-probabilities), and OpenAI's JSON back;
- :mod:`.scheduler`: the one thread that owns the model, gathering waiting requests into
  blocks and handing each row's tokens back as the block decodes;
- :mod:`.metrics`: counters, rendered in the Prometheus text format;
- :mod:`.app`: the FastAPI application (routes, SSE, errors, the API key).
"""
