"""The server (`dgemma serve`): the OpenAI API over HTTP (app.py: the routes and serve; requests.py with messages.py
and constraints.py: a body checked into a job; answering.py: the loop's events into whole and streamed answers;
protocol.py: limits, the error shape, fields, server-sent events; state.py: what the handlers share), the Responses
API (responses_api.py) and Ollama's (ollama_api.py) on the same engine, the loop that batches requests at every
denoise step (batching.py), the prompt cache (prefix_cache.py), log-probabilities (logprobs.py), and the walls every
request passes first: the Host/Origin guard (guard.py), body limits (body.py), the header deadline
(header_timeout.py).

Owns: HTTP, the APIs' JSON, concurrency between requests, hostile input.
May import the engine and everything below it, and the store; never the CLI (its flags are checked there and passed
in). Nothing but the CLI imports it.
"""
