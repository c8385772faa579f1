"""The OpenAI-compatible HTTP server (aiohttp) in front of the async engine."""
