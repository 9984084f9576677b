"""The HTTP layer both services share (aiohttp): request ids and metrics, auth and limits
middleware, the one mapping of domain errors to responses, health and /metrics."""
