"""Side by side: conveyor, transformers (static padded batches) and, optionally, vLLM-CPU.

One seeded workload (benchmarks/throughput.py's make_workload: prompts uniform in
[--min-prompt, --max-prompt], outputs exponential with mean --mean-output clipped to
[--min-output, --max-output], greedy, ignore_eos) runs through every side. Each side runs
--repeats times, interleaved, and the fastest run counts. Every repeat draws fresh prompt token
ids of the same lengths, the same for every side, and every side warms up on prompts of its
own: no side reuses work (conveyor's prefix cache, vLLM's), and conveyor's
`prompt_tokens_from_cache` says per repeat how many prompt tokens it still found cached.
vLLM runs only when --vllm-python names an interpreter that has vLLM installed: each of its
runs is a fresh subprocess of that interpreter (VLLM_CPU_KVCACHE_SPACE=2,
VLLM_CPU_OMP_THREADS_BIND=0-1) that reads the workload as JSON on stdin, warms up on one batch
of the warm-up prompts, times LLM.generate over the workload and prints its seconds and token
count as JSON (model loading is not timed on any side). conveyor runs at --dtype (float32 by
default, vLLM's side here being float32 and eager: matched precision; benchmarks/serve_peers.py
compares servers at each side's defaults).

The same run also reports, on conveyor's loaded model:
  gemm_floor  every linear of one decode step (each layer's qkv, o, gate_up, down and the
              lm_head) applied back to back to a [max_num_seqs, in_features] input: what a
              decode step costs in GEMMs alone. One pass runs after each timed step of
              step_split (interleaved, so both see the same moments of a noisy machine).
  step_split  a steady batch of max_num_seqs decodes driven by LLMEngine.step(): the mean
              wall time of step() against the model's forward (LlamaForCausalLM.forward,
              timed by forward hooks) and compute_logits, and ModelRunner.execute; and the
              step against the floor: best / best, median / median, and the median of each
              step over the floor pass right after it.

The model is --model DIR, or --shape NAME: a random-weight Llama (seeded) written to a temp
folder with the demo model's tokenizer. stdout has one JSON object; progress goes to stderr.

    python benchmarks/side_by_side.py --shape llama75m --vllm-python /opt/vllm/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers

from conveyor import LLM, SamplingParams
from conveyor.load_client.sibling import load_sibling
from conveyor.model.loading.demo import demo_model_path

throughput = load_sibling(__file__, "throughput")

SHAPES: dict[str, dict] = {
    "tiny3": dict(
        hidden_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=1000,
    ),
    "llama75m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=1000,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
}

RESULT_MARK = "SIDE_BY_SIDE_RESULT "

VLLM_SCRIPT = f"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
w = json.load(sys.stdin)
n = w["max_num_seqs"]
llm = LLM(model=w["model"], max_num_seqs=n, max_model_len=512, enforce_eager=True,
          dtype="float32", seed=0)
prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in w["out_lens"]]
warm = [TokensPrompt(prompt_token_ids=p) for p in w["warm_up"][:n]]
llm.generate(warm, params[:n], use_tqdm=False)
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print({RESULT_MARK!r} + json.dumps({{"seconds": seconds, "output_tokens": tokens}}), flush=True)
"""


def write_shape(name: str, folder: Path, seed: int) -> Path:
    """A random-weight Llama checkpoint of shape `name` in `folder`, with the demo tokenizer."""
    spec = dict(SHAPES[name])
    theta = spec.pop("rope_theta", 10000.0)
    config = transformers.LlamaConfig(
        **spec,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=theta,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(folder))
    demo = demo_model_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo / f, folder / f)
    return folder


def vllm_runner(python: str, model: str, warm_up, batch_size: int, timeout: float):
    """A function that runs a workload (prompts, out_lens) in a fresh vLLM-CPU subprocess;
    returns its seconds (and None for the cache hits, which it does not report)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")

    def run(prompts, out_lens) -> tuple[float, None]:
        payload = json.dumps(
            {"model": model, "max_num_seqs": batch_size, "prompts": prompts,
             "out_lens": out_lens, "warm_up": warm_up[0]}
        )  # fmt: skip
        # -I and a neutral cwd: the repo root must not be on its path (our top-level
        # kernels/ would shadow the `kernels` package transformers probes for).
        proc = subprocess.run(
            [python, "-I", "-c", VLLM_SCRIPT],
            cwd=tempfile.gettempdir(),
            input=payload,
            stdout=subprocess.PIPE,
            stderr=None,  # vLLM's logs go straight to our stderr
            text=True,
            env=env,
            timeout=timeout,
        )
        found = None
        for line in proc.stdout.splitlines():
            if line.startswith(RESULT_MARK):
                found = json.loads(line[len(RESULT_MARK) :])
            else:
                print(line, file=sys.stderr)
        if proc.returncode != 0 or found is None:
            raise RuntimeError(f"the vLLM subprocess failed (exit status {proc.returncode})")
        if found["output_tokens"] != sum(out_lens):
            raise RuntimeError(
                f"vLLM produced {found['output_tokens']} tokens, expected {sum(out_lens)}"
            )
        return float(found["seconds"]), None

    return run


def _linears(model) -> list[tuple[str, object, int]]:
    """(name, callable, in_features) for every linear of one decode step, in order."""
    cfg = model.config
    q_size = cfg.num_attention_heads * cfg.head_dim
    out = []
    for i, layer in enumerate(model.model.layers):
        out += [
            (f"{i}.qkv_proj", layer.self_attn.qkv_proj, cfg.hidden_size),
            (f"{i}.o_proj", layer.self_attn.o_proj, q_size),
            (f"{i}.gate_up_proj", layer.mlp.gate_up_proj, cfg.hidden_size),
            (f"{i}.down_proj", layer.mlp.down_proj, cfg.intermediate_size),
        ]
    if model.lm_head is not None:
        head = model.lm_head
    else:  # tied and not packed: compute_logits' own F.linear on the embedding
        weight = model.model.embed_tokens.weight
        head = lambda x: torch.nn.functional.linear(x, weight)  # noqa: E731
    out.append(("lm_head", head, cfg.hidden_size))
    return out


def floor_pass(model, batch: int) -> Callable[[], float]:
    """One pass of every linear of a decode step on [batch, in_features] inputs; returns its
    seconds when called."""
    linears = _linears(model)
    dtype = next(model.parameters()).dtype
    inputs = {n: torch.randn(batch, n, dtype=dtype) for n in {k for _, _, k in linears}}

    @torch.inference_mode()
    def once() -> float:
        start = time.perf_counter()
        for _, f, k in linears:
            f(inputs[k])
        return time.perf_counter() - start

    for _ in range(3):
        once()
    return once


def gemm_floor(model, batch: int, times: list[float]) -> dict:
    """The floor from `times`, seconds of floor_pass runs (interleaved with the steps)."""
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, m = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * m + m * h
    weights = cfg.num_hidden_layers * per_layer + h * cfg.vocab_size
    best = min(times)
    linears = _linears(model)
    return {
        "measured": "each layer's qkv, o, gate_up, down + lm_head of conveyor's loaded model, "
        "back to back on a [batch, in_features] input, one pass after each timed step of "
        "step_split; best of them (and their median)",
        "batch": batch,
        "num_linears": len(linears),
        "linear_type": type(linears[0][1]).__name__,
        "repeats": len(times),
        "seconds": round(best, 6),
        "ms": round(best * 1e3, 3),
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "gflop_per_s": round(2 * batch * weights / best / 1e9, 1),
        "decode_tok_per_s_ceiling": round(batch / best, 1),
    }


def step_split(
    llm: LLM,
    batch: int,
    prompt_len: int,
    vocab: int,
    warm: int,
    steps: int,
    between: Callable[[], float] | None = None,
) -> tuple[dict, list[float]]:
    """Mean step() vs forward time over `steps` steps of `batch` steady decodes. `between`
    (the floor pass) runs after each timed step, so that both see the same moments of a noisy
    machine; its seconds come back with the split."""
    engine = llm.llm_engine
    runner = engine.runner
    model = runner.model
    params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 4, ignore_eos=True)
    for i in range(batch):
        ids = [(100 + 7 * i + j) % (vocab - 200) + 100 for j in range(prompt_len)]
        engine.add_request(f"split-{i}", ids, params)
    engine.step()  # the prefill of all of them (prompt_len * batch <= the token budget)
    for _ in range(warm):
        engine.step()

    acc = {"forward": 0.0, "logits": 0.0, "execute": 0.0}
    t0: list[float] = []

    def pre(*_):
        t0.append(time.perf_counter())

    def post(*_):
        acc["forward"] += time.perf_counter() - t0.pop()

    orig_logits, orig_execute = model.compute_logits, runner.execute

    def logits(hidden):
        s = time.perf_counter()
        r = orig_logits(hidden)
        acc["logits"] += time.perf_counter() - s
        return r

    def execute(out):
        s = time.perf_counter()
        r = orig_execute(out)
        acc["execute"] += time.perf_counter() - s
        return r

    h1 = model.register_forward_pre_hook(pre)
    h2 = model.register_forward_hook(post)
    model.compute_logits, runner.execute = logits, execute
    step_times, between_times, tokens_ok = [], [], True
    try:
        for _ in range(steps):
            s = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - s)
            tokens_ok &= engine.last_step_num_tokens == batch
            if between is not None:
                between_times.append(between())
    finally:
        h1.remove()
        h2.remove()
        del model.compute_logits, runner.execute  # back to the class methods
    while engine.has_unfinished_requests():
        engine.step()
    per = {k: v / steps for k, v in acc.items()}
    step = sum(step_times) / steps
    model_s = per["forward"] + per["logits"]
    split = {
        "measured": (
            "mean wall time per LLMEngine.step() over steady steps of `batch` decodes (one "
            "token each), against LlamaForCausalLM.forward (forward hooks: decoder layers + "
            "final norm), compute_logits (lm_head) and ModelRunner.execute (input prep + "
            "forward + logits + sampler), all time.perf_counter"
        ),
        "batch": batch,
        "context_tokens_at_start": prompt_len + warm + 1,
        "steps": steps,
        "all_steps_were_pure_decode": bool(tokens_ok),
        "step_ms": round(step * 1e3, 3),
        "step_min_ms": round(min(step_times) * 1e3, 3),
        "step_median_ms": round(statistics.median(step_times) * 1e3, 3),
        "execute_ms": round(per["execute"] * 1e3, 3),
        "forward_ms": round(per["forward"] * 1e3, 3),
        "logits_ms": round(per["logits"] * 1e3, 3),
        "engine_overhead_fraction": round((step - per["forward"]) / step, 3),
        "overhead_outside_forward_and_logits_fraction": round((step - model_s) / step, 3),
        "outside_runner_execute_fraction": round((step - per["execute"]) / step, 3),
    }
    if between_times:  # step i against the floor pass right after it
        paired = [a / b for a, b in zip(step_times, between_times, strict=True)]
        split["step_to_floor_paired_median"] = round(statistics.median(paired), 3)
    return split, between_times


def _check_vllm_python(p: argparse.ArgumentParser, python: str) -> None:
    path = shutil.which(python) or python
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        p.error(f"--vllm-python {python!r}: no such executable file")
    try:
        check = subprocess.run(
            [path, "-c", "import vllm"], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.SubprocessError) as exc:
        p.error(f"--vllm-python {python!r} could not be run: {exc}")
    if check.returncode != 0:
        tail = (check.stderr.strip().splitlines() or ["(no output)"])[-1]
        p.error(f"--vllm-python {python!r} cannot import vllm: {tail}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF Llama checkpoint folder")
    src.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random-weight Llama")
    p.add_argument("--vllm-python", default=None, help="a Python interpreter with vLLM installed")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", "--max-num-seqs", dest="batch_size", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--mean-output", type=float, default=48.0)
    p.add_argument("--min-output", type=int, default=4)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs per side; the best counts")
    p.add_argument("--split-steps", type=int, default=32, help="timed steps for step_split")
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds per vLLM run")
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="conveyor's attention backend (auto, cpu, torch); the JSON records it",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="conveyor's dtype (float32: vLLM's here; bfloat16: bf16 weights and KV cache)",
    )
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.vllm_python is not None:
        _check_vllm_python(p, args.vllm_python)
    progress = not args.disable_tqdm

    with model_folder(args, "side_by_side") as model:
        return _run(args, model, progress)


@contextlib.contextmanager
def model_folder(args: argparse.Namespace, prefix: str) -> Iterator[str]:
    """The checkpoint a benchmark runs: `--shape`'s random-weight Llama written to a temporary
    folder (removed afterwards, seeded by `--seed`), else `--model`, else the demo model."""
    if not args.shape:
        yield args.model or str(demo_model_path())
        return
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}_{args.shape}_"))
    try:
        yield str(write_shape(args.shape, tmp, args.seed))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args, model: str, progress: bool) -> dict:
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    warm = throughput.make_workload(args, vocab, ids_seed=throughput.WARM_UP_IDS)
    bs = args.batch_size
    runners = {
        "conveyor": throughput.conveyor_runner(
            model, warm, bs, progress, attention_backend=args.attention_backend, dtype=args.dtype
        ),
        "transformers_static": throughput.transformers_runner(model, warm, bs, progress),
    }
    if args.vllm_python:
        python = shutil.which(args.vllm_python) or args.vllm_python
        runners["vllm_cpu"] = vllm_runner(python, model, warm, bs, args.vllm_timeout)
    times, out_lens = throughput.run_interleaved(runners, args, vocab)
    del runners  # free the models before the analyses load one more

    result: dict = {
        "model": f"shape:{args.shape}" if args.shape else model,
        "shape": SHAPES.get(args.shape) if args.shape else None,
        "workload": {
            "num_requests": args.num_requests,
            "prompt_tokens": [args.min_prompt, args.max_prompt],
            "output_tokens": [args.min_output, args.max_output],
            "mean_output_tokens": args.mean_output,
            "total_prompt_tokens": sum(map(len, throughput.make_workload(args, vocab)[0])),
            "total_output_tokens": sum(out_lens),
            "max_num_seqs": bs,
            "seed": args.seed,
            "sampling": "greedy, ignore_eos",
            "fresh_prompt_ids_every_repeat": True,
        },
        "conveyor_dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "attention_backend": args.attention_backend,
        "repeats": args.repeats,
    }
    for name, ts in times.items():
        result[name] = throughput._result(args.num_requests, sum(out_lens), ts)
    if "vllm_cpu" not in times:
        result["vllm_cpu"] = None
    tps = {k: result[k]["output_tokens_per_s"] for k in times}
    result["ratio_conveyor_to_transformers"] = round(
        tps["conveyor"] / tps["transformers_static"], 2
    )
    result["ratio_conveyor_to_vllm"] = (
        round(tps["conveyor"] / tps["vllm_cpu"], 2) if "vllm_cpu" in tps else None
    )

    print("[side_by_side] gemm floor and step split", file=sys.stderr, flush=True)
    llm = LLM(
        model,
        max_num_seqs=bs,
        max_num_batched_tokens=2048,
        seed=0,
        attention_backend=args.attention_backend,
        dtype=args.dtype,
    )
    runner_model = llm.llm_engine.runner.model
    once = floor_pass(runner_model, bs)
    split, floor_times = step_split(llm, bs, 64, vocab, 4, args.split_steps, between=once)
    floor = result["gemm_floor"] = gemm_floor(runner_model, bs, floor_times)
    split["gemm_floor_fraction_of_step"] = round(floor["ms"] / split["step_ms"], 3)
    # Like with like on a noisy machine: the best step against the best floor pass, the median
    # against the median, and (above) each step against the pass right after it.
    split["step_to_floor_best"] = round(split["step_min_ms"] / floor["ms"], 3)
    split["step_to_floor_median"] = round(split["step_median_ms"] / floor["median_ms"], 3)
    result["step_split"] = split
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
