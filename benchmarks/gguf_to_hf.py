"""A GGUF file as an HF checkpoint folder (safetensors + tokenizer), for peers that load only
HF checkpoints (vllm serve), so that every side of a comparison serves the same weights.

transformers reads the file (dequantizing every tensor) and writes the folder in --dtype.

    python benchmarks/gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write `gguf` as an HF checkpoint in `out`; returns `out`."""
    kwargs = {"gguf_file": gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype=getattr(torch, dtype), **kwargs
    )
    # The tensors are dequantized already; transformers still marks the model as GGUF.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    print(convert(args.gguf, args.out, args.dtype))


if __name__ == "__main__":
    main()
