"""`cachegraft serve`: an HTTP server over loaded stores (OpenAI-compatible chat, the native
ask / retrieve endpoints), and the client `ask --server` uses.

`requests.py` checks request bodies; `worker.py` queues questions and decodes them in a
continuous batch (`lm/batching.py`) on one worker thread; `http.py` is the Starlette app;
`server.py` starts it under uvicorn; `client.py` talks to a running server with the standard
library alone. Starlette and uvicorn are the `serve` extra: `http.py` imports Starlette at its
top and is imported only inside `server.py`'s functions; uvicorn is imported inside functions.
"""
