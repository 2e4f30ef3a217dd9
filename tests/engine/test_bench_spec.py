"""loadtest.bench_spec's target: wired so its greedy text after a chain token is the chain, whatever precedes."""
from __future__ import annotations

import torch
import transformers

from loadtest.bench_spec import _wire_chain

from .conftest import hf_greedy


def test_wired_target_writes_the_chain():
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    chain = torch.randperm(200)[:100].add(100).tolist()
    with torch.no_grad():
        _wire_chain(model, chain)
    for start, junk in ((5, [7, 8, 9]), (60, chain[10:30] + [3])):
        assert hf_greedy(model, junk + [chain[start]], 12) == chain[start + 1:start + 13]
