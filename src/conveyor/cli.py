"""The `conveyor` command line: one argparse subcommand per job.

Adding a command (`serve`, `simulate`, `bench`, ...) means writing two functions, `_add_<name>`
(its subparser, ending in `set_defaults(func=_<name>)`) and `_<name>(args) -> int` (the work),
and listing `_add_<name>` in `_COMMANDS`. Commands import their heavy modules (torch, the
engine) inside `_<name>`, so `conveyor --version` and `--help` stay instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from conveyor import __version__


def _add_demo_model(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo-model",
        help="write the embedded demo checkpoint (Hugging Face format) to DIR",
        description="Write the small random Llama demo checkpoint, with its BPE tokenizer and "
        "chat template, to DIR (created if missing; must be empty). transformers loads it too.",
    )
    parser.add_argument("dir", metavar="DIR", type=Path, help="output directory")
    parser.set_defaults(func=_demo_model)


def _demo_model(args: argparse.Namespace) -> int:
    from conveyor.demo import write_demo_model

    print(write_demo_model(args.dir).resolve())
    return 0


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate",
        help="complete prompts offline with LLM.generate (demo model without --model)",
        description="Complete each PROMPT with continuous batching and print the results.",
    )
    parser.add_argument("prompts", metavar="PROMPT", nargs="+", help="prompt text")
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: demo)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from conveyor import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    llm = LLM(args.model)
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        print(
            f"--- {out.prompt!r} ({completion.finish_reason}, {len(completion.token_ids)} tokens)"
        )
        print(out.prompt + completion.text)
    return 0


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_demo_model,
    _add_generate,
)


def build_parser() -> argparse.ArgumentParser:
    """Build the `conveyor` argument parser with every subcommand registered.

    Returns:
        The top-level parser; parsed args carry `func`, the command to run.
    """
    parser = argparse.ArgumentParser(
        prog="conveyor",
        description="A small LLM inference server: continuous batching over a paged KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"conveyor {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in _COMMANDS:
        add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `conveyor` command line.

    Args:
        argv: arguments without the program name; None reads `sys.argv[1:]`.

    Returns:
        The process exit status: 0 on success, 2 for a usage error or a ValueError.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return args.func(args)
    except ValueError as exc:  # the user's mistake: say what to fix, no traceback
        print(f"conveyor {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
