"""POST /v1/responses: the Responses API, its protocol and serving."""
