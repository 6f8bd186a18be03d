"""Speculative decoding: proposers (drafters), the shared rejection sampler, the engine glue.

See docs/engine.md, "Speculative decoding".
"""
