"""shapegate: one OpenAI-compatible endpoint in front of a portfolio of inference engines."""
