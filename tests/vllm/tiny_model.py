"""A tiny Llama checkpoint directory for vLLM, built offline (no download).

``write_tiny_llama(path, **overrides)`` writes ``config.json`` (2 layers,
hidden 128, 4 heads of 32, vocab 1024), a word-level tokenizer built with the
``tokenizers`` library (``tokenizer.json`` + ``tokenizer_config.json``: the
words ``w0`` .. ``w1020`` plus ``<unk>``, ``<s>``, ``</s>``) and
``generation_config.json``, and ``model.safetensors``: random weights drawn
from ``torch.Generator().manual_seed(weight_seed)``, so every process and
every machine gets the same model, and two seeds give two models of the same
shapes whose KV values differ.

Why real random weights and not ``load_format="dummy"``: vLLM's dummy loader
fills every tensor with uniform values in +-1e-3 (seed fixed per tensor).
Attention scores are then ~0, the output hardly depends on the context, and
a test could not tell a loaded KV cache from a garbage one. Weights scaled so
that attention scores have a spread of a few units make the next token depend
on every earlier token's K and V.

Importable without vLLM; writing needs ``tokenizers``, ``torch`` and
``safetensors`` (all in .venv-vllm).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 1024
SPECIAL = ["<unk>", "<s>", "</s>"]
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIAL))]

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "unk_token_id": 0,
    "torch_dtype": "float32",
}


def write_tokenizer(path: Path) -> None:
    """A whitespace-split word-level tokenizer over ``SPECIAL + WORDS``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": CONFIG["max_position_embeddings"],
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}))


def write_weights(path: Path, config: dict[str, Any], seed: int) -> None:
    """``model.safetensors`` for ``LlamaForCausalLM`` with seeded normal weights (float32)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], h, std=1.0),
         "model.norm.weight": torch.ones(h),
         "lm_head.weight": normal(config["vocab_size"], h, std=0.2)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(heads * dim, h, std=0.15),
              p + "self_attn.k_proj.weight": normal(kv_heads * dim, h, std=0.15),
              p + "self_attn.v_proj.weight": normal(kv_heads * dim, h, std=0.15),
              p + "self_attn.o_proj.weight": normal(h, heads * dim, std=0.15),
              p + "mlp.gate_proj.weight": normal(inter, h, std=0.1),
              p + "mlp.up_proj.weight": normal(inter, h, std=0.1),
              p + "mlp.down_proj.weight": normal(h, inter, std=0.1),
              p + "input_layernorm.weight": torch.ones(h),
              p + "post_attention_layernorm.weight": torch.ones(h)}
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})


def write_tiny_llama(path: Path, weight_seed: int = 0, **overrides: Any) -> Path:
    """Write the checkpoint directory at ``path`` (created if needed); returns ``path``.

    ``weight_seed`` picks the weights; ``overrides`` change config fields
    (e.g. ``num_key_value_heads=2`` for a model whose KV blocks have another size).
    """
    path.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_weights(path, config, weight_seed)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}))
    write_tokenizer(path)
    return path


def prompt_words(seed: int, n: int) -> str:
    """``n`` pseudo-random words (a fixed LCG, no RNG state), as one prompt string."""
    x, out = seed * 7919 + 17, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(WORDS[x % len(WORDS)])
    return " ".join(out)
