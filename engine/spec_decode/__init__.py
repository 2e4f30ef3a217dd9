"""Speculative decoding: proposers guess the next tokens, the target model verifies them in the batched forward pass
(docs/engine.md, "Speculative decoding")."""
