"""POST /v1/chat/completions: serving, tool calls and their parsers, audio content parts."""
