"""HTTP serving layer: OpenAI- and Anthropic-compatible request models, response builders and output parsers."""
