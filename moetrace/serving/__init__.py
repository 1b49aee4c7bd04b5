"""``moetrace serve``: the engine behind an OpenAI-compatible HTTP server (docs/serving.md)."""
