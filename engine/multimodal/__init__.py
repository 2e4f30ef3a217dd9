"""Images in: a prompt's images placed at its placeholder tokens (inputs), the checkpoint's image processor
(processor), the encoder cache (encoder_cache), a step's splices and M-RoPE positions (step, mrope), and the
prefix-cache keys of the blocks images fill (block_keys)."""
