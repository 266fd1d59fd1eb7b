"""GET /v1/models and /v1/models/{model}."""
