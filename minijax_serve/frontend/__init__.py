"""The request front end: input checks and chat templates, outputs handed to callers, the
detokenizer and structured output (grammars)."""
