"""Token selection: logits processing, seeded sampling and logprobs."""
