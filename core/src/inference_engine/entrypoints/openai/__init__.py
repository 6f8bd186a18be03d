"""The OpenAI-compatible HTTP server (``inference-engine serve``).

``app.build_app`` makes the ASGI application around an :class:`AsyncLLM`;
``server.run_server`` runs it under uvicorn with graceful shutdown. Request
bodies are validated in ``protocol``, errors take the OpenAI shape from
``errors``, and ``completions`` / ``chat`` turn engine outputs into responses.
"""
