"""POST /v1/audio/transcriptions and /v1/audio/translations."""
