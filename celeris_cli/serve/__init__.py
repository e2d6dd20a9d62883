"""`celeris serve`: the OpenAI API over one loaded engine, and the Batch API over the spool queue.

HTTP lives here only: `app` builds the ASGI app from a `Runner` (the engine's one worker thread, which
decodes waiting requests together), a `FileStore` and, with a queue config, a `BatchStore` whose state is
the queue's own folders. Nothing below this package knows of HTTP.
"""
