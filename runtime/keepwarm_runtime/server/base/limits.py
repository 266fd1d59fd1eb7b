"""Server-wide default limits, defined once (the CLI, the guards and the serving base import them)."""

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # larger bodies get 413 before they are read
DEFAULT_PREPROCESS_TIMEOUT_S = 30.0  # tokenizing + rendering one request
DEFAULT_MAX_MEDIA_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit: /v1/audio/* uploads, fetched audio_url
DEFAULT_FETCH_TIMEOUT_S = 10.0  # one audio_url fetch, redirects included
