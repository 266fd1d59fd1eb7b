"""OpenAI-compatible HTTP server over the engine: `keepwarm serve` (cli.py), the app (app.py).

Layout (vLLM's serving shape: one folder per route group over a shared base):
- ``app.py``: builds the FastAPI app; registers every route from one list of route groups.
- ``engine_client.py`` (what the server needs from an engine, capabilities stated), ``async_engine.py``.
- ``base/``: what every route shares: ``routes.py`` (the ``Route`` declaration), ``serving.py``
  (``ServingContext``), ``protocol.py`` (the models several groups share: the request base and its
  unknown-field report, sampling fields, chat messages, usage, errors, logprobs), ``errors.py``,
  ``sse.py``, ``guards.py``, ``linger.py``, ``metrics.py``, ``limits.py``, ``request_body.py``,
  ``openapi.py``, ``deltas.py``, ``logprobs.py``, ``media_fetch.py``.
- ``probes/router.py``: /health, /ping, /ready, /version, /metrics, /debug/stats.
- ``openai/<group>/``: ``models`` (``router.py``), ``chat`` (with tools, tool parsers, audio parts),
  ``completions``, ``responses``, ``tokenize``, ``audio``, ``lora`` (with the ``--lora-modules``
  values and the ``--lora-modules-file`` sync), ``sleep``; each group's ``serving.py`` (or
  ``router.py``) holds its handlers and declares its ``ROUTES``, and its ``protocol.py`` its own
  request and response models (audio and sleep have none: multipart forms, with the transcript
  formats in ``audio/transcript_formats.py``, and plain JSON). ``base/protocol.py`` imports no group.
- Process level, unchanged: ``cli.py``, ``settings.py``, ``launcher.py``, ``supervisor.py``, ``listener.py``,
  ``worker_probe.py``, ``preload.py``.
"""
