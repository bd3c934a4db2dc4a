"""`lowbit serve`: an OpenAI-compatible server on the transformers runtime with lowbit's KV cache.

    runtime.py   load model + tokenizer + KV scheme (+ quantized weights, + an export's sidecar)
    kvcache.py   one cache per request, bytes and quantized tokens measured from its tensors
    sampling.py  greedy / temperature / top-p with a per-request seed; detokenizer with stop strings
    engine.py    one worker thread; requests interleaved token by token, each with its own cache
    metrics.py   counters behind /metrics
    app.py       the FastAPI app (OpenAI routes, SSE, errors)
    server.py    bind (clear error on a port in use), uvicorn, BackgroundServer for tests

Nothing is imported here, so `import lowbit.serve.x` does not pull in FastAPI unless needed.
"""
