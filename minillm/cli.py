"""``python -m minillm``: the command line.

``generate`` runs the chapter-0 generation loop on one prompt. Later chapters add sub-commands (``chat``, ``bench``,
``serve``) here, mirroring ``vllm`` 's own CLI (``vllm/entrypoints/cli/``).
"""
from __future__ import annotations

import argparse
import os
import sys


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description="A small vLLM-style inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt and print the text")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: SmolLM2)")
    gen.add_argument("--max-tokens", type=_positive_int, default=64, help="most new tokens (default 64)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=0, help="random seed for temperature > 0")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import minillm

    model, tok = minillm.load_model(args.model)
    if tok is None:
        print("error: this model directory has no tokenizer files", file=sys.stderr)
        return 2
    ids = tok.encode(args.prompt) if args.raw else minillm.chat_prompt_ids(tok, args.prompt)
    gen = torch.Generator().manual_seed(args.seed)
    out = minillm.generate(model, ids, args.max_tokens, args.temperature, generator=gen)
    print(tok.decode(out, skip_special_tokens=True).strip())
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args)
    raise AssertionError(f"unhandled command {args.command}")  # argparse rejects unknown commands first
