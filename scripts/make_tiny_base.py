"""Build the small embedded default base model: a tiny random transformers Qwen3 with a real byte-level BPE
tokenizer trained on a text file, saved as an ordinary transformers checkpoint folder.

    python scripts/make_tiny_base.py OUT --text corpus/train.txt [--vocab-size 2048] [--layers 4]
"""

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM


def read_texts(path: Path):
    """Lines of a text file, or the "text" field of each line of a .jsonl file."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"] if path.suffix == ".jsonl" else line


def train_tokenizer(text_file: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(read_texts(text_file), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="output checkpoint folder")
    parser.add_argument("--text", type=Path, required=True, help="text (.txt) or documents (.jsonl, field text) to train the tokenizer on")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = train_tokenizer(args.text, args.vocab_size)
    torch.manual_seed(args.seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen3 base: {n / 1e6:.2f}M parameters, vocab {len(tokenizer)}, {args.layers} layers -> {args.out}")


if __name__ == "__main__":
    main()
