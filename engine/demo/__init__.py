"""The demo checkpoint's recipe: a templated dialogue corpus (``corpus``), a byte-level BPE tokenizer and a small
Llama trained on it (``train``). The trained folder ships in ``checkpoint/``; ``engine.demo_model`` installs it."""
