"""engc's HTTP server: OpenAI and Anthropic APIs over one AsyncEngine (see docs/serving.md)."""
