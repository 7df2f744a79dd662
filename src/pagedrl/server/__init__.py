"""OpenAI-compatible HTTP server over the paged engine: `pagedrl serve` (serve.py), the app (app.py)."""
