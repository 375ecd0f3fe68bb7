"""``meshplan serve``: the resident job behind an OpenAI-compatible HTTP API.

The data flow, one module each: ``protocol`` reads a request body into a ``Submission``
(or one ``BadRequest``), ``chat`` renders chat messages with the model folder's template,
``engine`` (rank 0, the thread that calls MPI) admits submissions into the plan's batch
slots and steps the job in token ids (``batching``: continuous batching in a shared
key/value buffer, requests told apart by the mask in a growing cache), ``link`` carries
submissions and the engine's events between rank 0 and the front's process (``front``),
where ``app`` is the ASGI application that streams them as text (``text``: a choice's
text, cut at stop strings), ``metrics`` the engine's Prometheus text, and ``server``
starts it all on every rank.
"""
