"""HTTP API: Ollama- and OpenAI-compatible endpoints."""
