"""Speculative decoding: proposing draft tokens per request, and deciding when and how many to verify."""
