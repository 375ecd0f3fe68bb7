"""``meshplan serve``: the resident job behind an OpenAI-compatible HTTP API.

The data flow, one module each: ``protocol`` reads a request body into a ``Submission``
(or one ``BadRequest``), ``chat`` renders chat messages with the model folder's template,
``engine`` (rank 0, the thread that calls MPI) admits submissions into the plan's batch
slots and steps the job (``batching``: continuous batching in a shared key/value buffer,
requests told apart by the mask in a growing cache), ``app`` is the ASGI application that
streams what the engine emits, ``metrics`` its Prometheus text, and ``server`` starts it
all on every rank.
"""
