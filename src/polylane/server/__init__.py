"""The OpenAI-compatible HTTP server: `polylane serve`."""
