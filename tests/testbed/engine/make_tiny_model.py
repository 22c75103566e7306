"""Write ``teamserve-tiny``: a 2-layer random-weight Llama with a BPE tokenizer and a chat template.

Runs at image build time, offline, with the image's own ``torch``/``transformers``/``tokenizers``.
It stands in for a real checkpoint (Hugging Face hub is unreachable here); the engine loads it through
the ordinary Hugging Face path (config.json + model.safetensors + tokenizer.json), so everything vLLM does
for a real Llama checkpoint — config parsing, weight loading, tokenising, chat templating, KV-cache
sizing — runs for real. Its answers are noise.

Usage: python make_tiny_model.py OUTPUT_DIR
Output: OUTPUT_DIR with config.json, generation_config.json, model.safetensors, tokenizer.json,
        tokenizer_config.json, chat_template.jinja (file names as written by transformers' save_pretrained).
Errors: SystemExit with a message when the argument is missing; exceptions from transformers/tokenizers.

Shape constraints (docs/testbed.md, "vLLM's CPU build"): the CPU attention backend
accepts head_dim 32, 64, 80, 96, 112, 128, ... but not 16, so head_dim is 64
(hidden_size 256 = 4 heads x 64).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 20261130
VOCAB_SIZE = 4096
BOS, EOS, PAD = "<|begin_of_text|>", "<|im_end|>", "<|pad|>"
IM_START = "<|im_start|>"
# ChatML layout (the format used by e.g. Qwen2 and many fine-tunes): role header, content, end marker.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def training_text() -> list[str]:
    """Return a fixed local corpus: the Python standard library's own .py sources, sorted by path.

    Deterministic for a given Debian python3.11 package; needs no network.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with exactly VOCAB_SIZE entries (special tokens included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, expected {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_tiny_model.py OUTPUT_DIR")
    out = Path(sys.argv[1])
    torch.manual_seed(SEED)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=torch.bfloat16,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.max_length = config.max_position_embeddings
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n_params} parameters, vocab {VOCAB_SIZE}, dtype {config.dtype}")


if __name__ == "__main__":
    main()
