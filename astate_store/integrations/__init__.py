"""Integrations with other systems: inference engines (vLLM), model formats."""
