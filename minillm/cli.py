"""``python -m minillm``: the command line.

- ``generate PROMPT``: answer one prompt through the engine and print the text.
- ``chat``: an interactive conversation in the terminal; the answer is streamed as the engine produces it.
- ``bench``: the offline throughput benchmark (minillm vs transformers vs the roofline, see ``bench/throughput.py``).
- ``serve``: an OpenAI-compatible HTTP server (``minillm.entrypoints.openai.api_server``).

``bench`` and ``serve`` run at ``--dtype auto`` unless told otherwise (bf16 on a CPU with AMX-BF16 or AVX512-BF16,
else fp32) and print the dtype and why at start-up; ``generate`` and ``chat`` run ``LLM()``'s fp32, like the lessons.

vLLM counterpart: ``vllm/entrypoints/cli/`` (``vllm serve``, ``vllm chat``, ``vllm bench``; ``vllm generate`` does not
exist there, ``LLM.generate`` is its Python twin).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any


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


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=_positive_int, default=max_tokens,
                        help=f"most new tokens (default {max_tokens})")
    parser.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for temperature > 0")
    parser.add_argument("--max-model-len", type=_positive_int, default=4096,
                        help="longest conversation in tokens (default 4096)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description="A small vLLM-style inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer one prompt and print the text")
    gen.add_argument("prompt", help="the prompt text")
    _add_sampling_args(gen, max_tokens=64)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="talk to the model in the terminal (streamed answers)")
    _add_sampling_args(chat, max_tokens=256)
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    chat.set_defaults(func=cmd_chat)

    from minillm.course.benchmarks.throughput import add_cli_args

    bench = sub.add_parser("bench", help="offline throughput: minillm vs transformers vs the roofline")
    add_cli_args(bench)
    bench.set_defaults(func=cmd_bench)

    try:
        from minillm.entrypoints.openai.api_server import add_serve_subparser
    except ImportError as e:  # the server's dependencies (fastapi, uvicorn) are missing
        serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (unavailable: see --help)")
        serve.set_defaults(func=lambda args, err=str(e): _unavailable("serve", err))
    else:
        add_serve_subparser(sub)
    return parser


def _unavailable(command: str, error: str) -> int:
    print(f"error: `{command}` cannot run here: {error}", file=sys.stderr)
    return 2


def _make_llm(args: argparse.Namespace) -> Any:
    from minillm.entrypoints.llm import LLM

    return LLM(args.model, max_model_len=args.max_model_len, seed=args.seed)


def _params(args: argparse.Namespace) -> Any:
    from minillm.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                          seed=args.seed if args.temperature > 0 else None)


def cmd_generate(args: argparse.Namespace) -> int:
    import minillm

    llm = _make_llm(args)
    tok = llm.get_tokenizer()
    if tok is None:
        print("error: this model directory has no tokenizer files", file=sys.stderr)
        return 2
    prompt = args.prompt if args.raw else {"prompt_token_ids": minillm.chat_prompt_ids(tok, args.prompt)}
    out = llm.generate(prompt, _params(args), use_tqdm=False)[0]
    print(out.outputs[0].text.strip())
    return 0


def cmd_chat(args: argparse.Namespace, stdin: Any = None, stdout: Any = None) -> int:
    """Read a message per line, stream the answer, keep the conversation. ``/reset`` forgets it; ``/exit`` or
    end of input (Ctrl-D) quits."""
    import minillm

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    llm = _make_llm(args)
    tok = llm.get_tokenizer()
    if tok is None:
        print("error: chat needs a tokenizer with a chat template", file=sys.stderr)
        return 2
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = stdin.isatty()
    if interactive:
        print("minillm chat: type a message, /reset to start over, /exit or Ctrl-D to quit.", file=stdout)
    while True:
        if interactive:
            print("you> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": text})
        ids = minillm.chat_prompt_ids(tok, messages)
        if len(ids) >= llm.llm_engine.max_model_len:
            print(f"[the conversation has {len(ids)} tokens, the limit is {llm.llm_engine.max_model_len}; "
                  f"/reset to start over]", file=stdout, flush=True)
            messages.pop()
            continue
        print("model> " if interactive else "", end="", file=stdout, flush=True)
        answer = ""
        for out in llm.generate_stream({"prompt_token_ids": ids}, _params(args)):
            delta = out.outputs[0].delta_text
            answer += delta
            print(delta, end="", file=stdout, flush=True)
        print(file=stdout, flush=True)
        messages.append({"role": "assistant", "content": answer})


def cmd_bench(args: argparse.Namespace) -> int:
    from minillm.course.benchmarks.throughput import main as bench_main

    bench_main(args=args)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad values that only the engine can check (e.g. a prompt too long)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the engine already dropped what it was running; no traceback for it
        print("\ninterrupted", file=sys.stderr)
        return 130
