"""The `conveyor` command line: one argparse subcommand per job.

Adding a command (`serve`, `simulate`, `bench`, ...) means writing two functions, `_add_<name>`
(its subparser, ending in `set_defaults(func=_<name>)`) and `_<name>(args) -> int` (the work),
and listing `_add_<name>` in `_COMMANDS`. Commands import their heavy modules (torch, the
engine) inside `_<name>`, so `conveyor --version` and `--help` stay instant; `serve`'s and
`simulate`'s settings flags are made from the config dataclasses' fields
(conveyor/config/settings.py), which are plain Python.
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
    from conveyor.model.loading.demo import write_demo_model

    print(write_demo_model(args.dir).resolve())
    return 0


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate",
        help="complete prompts offline with LLM.generate (demo model without --model)",
        description="Complete each PROMPT with continuous batching and print the results.",
    )
    parser.add_argument("prompts", metavar="PROMPT", nargs="+", help="prompt text")
    parser.add_argument(
        "--model", metavar="PATH", help="HF checkpoint folder or .gguf file (default: demo)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send each PROMPT as one user message through the chat template (LLM.chat)",
    )
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from conveyor import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    llm = LLM(args.model)
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs, strict=True):
        completion = out.outputs[0]
        print(f"--- {prompt!r} ({completion.finish_reason}, {len(completion.token_ids)} tokens)")
        # A chat reply stands alone; a completion continues its prompt.
        print(completion.text if args.chat else prompt + completion.text)
    return 0


def _add_serve(commands: argparse._SubParsersAction) -> None:
    from conveyor.config import EngineConfig
    from conveyor.config.settings import add_sectioned_flags
    from conveyor.server.config import ServerConfig

    parser = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API (demo model without --model)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/responses, "
        "/v1/embeddings, /v1/models, /health, /metrics, /tokenize and /detokenize. Settings "
        "come from the built-in defaults, then "
        "--config FILE, then these flags. SIGTERM or Ctrl-C stops admitting requests, lets "
        "in-flight ones finish for --shutdown-timeout seconds, then aborts the rest.",
    )
    # The flags are the fields of EngineConfig and ServerConfig (conveyor/config/settings.py), each
    # with the default None: an unset flag leaves the config file's value (or the field's).
    parser.add_argument(
        "--config", metavar="FILE", type=Path, help="YAML settings, e.g. configs/demo.yaml"
    )
    add_sectioned_flags(parser, EngineConfig, ServerConfig)
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from conveyor.server.config import build_serve_config

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "config")}
    engine_config, server_config = build_serve_config(args.config, flags)
    from conveyor.server.launch import run_server

    return run_server(engine_config, server_config)


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    from conveyor.config import EngineConfig
    from conveyor.config.settings import add_flags

    parser = commands.add_parser(
        "simulate",
        help="replay a request trace under scheduling policies with a step-cost model",
        description="Replay a trace (--trace FILE, JSON or CSV) or a named synthetic workload "
        "through the real scheduler and KV block manager, with a step-cost model in place of "
        "the model (no weights), and print iterations, batch size, utilization, throughput, "
        "TTFT and e2e latency percentiles and preemptions per policy.",
    )
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, metavar="FILE", help="JSON or CSV trace file")
    source.add_argument(
        "--workload",
        default="exponential",
        help="exponential (default), uniform, lognormal, bimodal, fixed, or the worked "
        "examples guide-static / guide-continuous of docs/scheduling.md (1 s steps, max "
        "batch 4 unless given)",
    )
    add("--num-requests", type=int, default=1000, metavar="N", help="synthetic requests")
    add("--rate", type=float, default=float("inf"), help="Poisson arrivals/s (default: all at 0)")
    add("--prompt-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    add("--mean-output", type=float, default=64.0, metavar="N", help="mean output tokens")
    add("--max-output", type=int, default=1024, metavar="N", help="output length cap")
    add("--seed", type=int, default=0, help="workload seed")
    # The engine's settings a simulation uses, from EngineConfig's fields (defaults included),
    # but for the policies to compare and the batch size, whose defaults are the simulator's.
    engine_flags = ("scheduler", "max_num_seqs", "max_num_batched_tokens", "block_size",
                    "num_kv_blocks", "aging_bound_s", "preemption_threshold",
                    "preemption_cooldown_s")  # fmt: skip
    add_flags(parser, EngineConfig, engine_flags, field_defaults=True, overrides={
        "scheduler": {"default": "all", "metavar": "NAMES",
                      "help": "a policy, a,b,c, or all (default)"},
        "max_num_seqs": {"default": None, "help": "max batch size (default 32; 4 for the "
                         "guide-* workloads)"},
        "num_kv_blocks": {"help": "KV cache blocks (default: no KV pressure)"},
    })  # fmt: skip
    add("--step-base-s", type=float, metavar="S", help="step cost: fixed seconds per step")
    add("--step-per-token-s", type=float, metavar="S", help="step cost: seconds per token")
    add("--step-per-seq-s", type=float, metavar="S", help="step cost: seconds per request")
    add("--output", type=Path, metavar="FILE", help="write summaries + timelines as JSON")
    add("--steps", action="store_true", help="also write per-step series to --output")
    parser.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    import json

    from conveyor.config import EngineConfig
    from conveyor.core.policies import available_policies
    from conveyor.simulator import StepCost, format_table, simulate
    from conveyor.simulator.trace import GUIDE_WORKLOADS, load_trace, synthetic_trace

    guide = args.trace is None and args.workload in GUIDE_WORKLOADS
    if args.trace is not None:
        trace = load_trace(args.trace)
    else:
        trace = synthetic_trace(
            args.workload,
            args.num_requests,
            rate=args.rate,
            prompt_len=tuple(args.prompt_len),
            mean_output=args.mean_output,
            max_output=args.max_output,
            seed=args.seed,
        )
    names = available_policies() if args.scheduler == "all" else args.scheduler.split(",")
    knobs = {k: getattr(args, k) for k in ("aging_bound_s", "preemption_threshold",
                                            "preemption_cooldown_s")}  # fmt: skip
    step_cost = {
        k: getattr(args, f"step_{k}")
        for k in ("base_s", "per_token_s", "per_seq_s")
        if getattr(args, f"step_{k}") is not None
    }
    if guide and not step_cost:
        step_cost = {"base_s": 1.0, "per_token_s": 0.0}  # the examples count in steps
    cost = StepCost(**step_cost)
    max_num_seqs = args.max_num_seqs or (4 if guide else 32)
    reports = {}
    for name in names:
        config = EngineConfig(
            scheduler=name.strip(),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            **knobs,
        )
        reports[config.scheduler] = simulate(trace, config, cost)
    print(
        f"{len(trace)} requests, max batch {max_num_seqs}, step cost {cost.base_s:g} s + "
        f"{cost.per_token_s:g} s/token + {cost.per_seq_s:g} s/request"
    )
    print(format_table([r.summary() for r in reports.values()]))
    if args.output is not None:
        data = {name: r.to_dict(timelines=True, steps=args.steps) for name, r in reports.items()}
        args.output.write_text(json.dumps(data, indent=1))
        print(f"wrote {args.output}")
    return 0


def _add_bench(commands: argparse._SubParsersAction) -> None:
    from conveyor.load_client.serve import add_arguments

    parser = commands.add_parser("bench", help="benchmarks (`conveyor bench serve`)")
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    serve = benches.add_parser(
        "serve",
        help="drive a running server and report throughput and latencies",
        description="Send a synthetic or JSONL workload to a running server's /v1/completions "
        "as streams (Poisson arrivals or all at once) and report successful and failed "
        "requests, throughput, and TTFT / TPOT / ITL / E2E latency like `vllm bench serve`.",
    )
    add_arguments(serve)
    serve.set_defaults(func=_bench_serve)


def _bench_serve(args: argparse.Namespace) -> int:
    from conveyor.load_client.serve import main as bench_main

    return bench_main(args)


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_demo_model,
    _add_generate,
    _add_serve,
    _add_simulate,
    _add_bench,
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
