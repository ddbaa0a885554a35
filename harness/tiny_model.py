"""tiny_model: a small HF-style model directory made on the spot (no network): config.json,
random bf16 safetensors and a byte-level BPE tokenizer trained on a few paragraphs of text.

What the training-API tests and the cookbook recipes run on: `transformers.AutoTokenizer`
loads the tokenizer, `weightsync.models.load_pretrained` the weights.
"""

from __future__ import annotations

from pathlib import Path

_CORPUS = (
    """
The quick brown fox jumps over the lazy dog. User: What is 2 + 3? Assistant: 5.
User: Hello there, how are you today? Assistant: I am fine, thank you for asking.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 42 99 100 256 1000.
Questions and answers about arithmetic, addition, subtraction, multiplication and division.
System: You are a helpful assistant. Answer briefly and correctly. The answer is \\boxed{7}.
"""
    * 4
)


def write_tokenizer(directory: Path, *, vocab_size: int = 1000) -> int:
    """Trains and saves the tokenizer; returns its vocabulary size (including special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|pad|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(directory)
    return tokenizer.get_vocab_size()


def write_tiny_model(
    directory: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    layers: int = 2,
    tokenizer: bool = True,
    vocab_size: int = 1000,
) -> Path:
    """An HF-style directory for a ~0.2M-parameter Qwen3-style decoder; returns its path."""
    from weightsync.models import ModelConfig, build_model, save_pretrained

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory, vocab_size=vocab_size) if tokenizer else vocab_size
    config = ModelConfig(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    save_pretrained(directory, config, build_model(config, seed=seed).state_dict())
    return directory
