"""OpenAI-compatible gateway, Redis-streams broker, engine worker and the pagedserve CLI."""
