"""The governor's HTTP front: OpenAI routes, health, metrics, admin."""
