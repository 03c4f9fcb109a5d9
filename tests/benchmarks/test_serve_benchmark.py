"""benchmarks/serve.py runs end to end on a tiny workload (speed is not checked): a
random-weight shape with token-id prompts below its vocabulary, both ratios from the rounds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from conveyor.load_client.sibling import load_sibling

pytestmark = pytest.mark.slow  # runs a benchmark script

serve = load_sibling(str(Path(__file__).resolve().parents[2] / "benchmarks" / "serve.py"), "serve")


@pytest.mark.slow  # a server with its engine process, plus an LLM in this process
def test_serve_benchmark_on_a_shape_reports_best_and_median_ratios(tmp_path, capsys) -> None:
    out = tmp_path / "serve.json"
    argv = ["--shape", "tiny3", "--num-prompts", "6", "--input-len", "5", "--output-len", "3"]
    argv += ["--rounds", "2", "--max-num-seqs", "4", "--num-kv-blocks", "64", "--disable-tqdm"]
    argv += ["--result-json", str(out), "--plot", str(tmp_path / "p.png")]
    result = serve.main(argv)
    assert json.loads(capsys.readouterr().out) == result == json.loads(out.read_text())
    assert result["model"] == "shape:tiny3" and result["server_exit_code"] == 0
    assert result["server"]["successful_requests"] == 6
    assert result["server"]["total_output_tokens"] == 6 * 3
    servers = result["server_output_throughput_per_round"]
    generates = result["llm_generate_output_throughput_per_round"]
    assert len(servers) == len(generates) == 2 and min(servers + generates) > 0
    assert result["ratio_best"] == round(max(servers) / max(generates), 3)
    ratios = [s / g for s, g in zip(servers, generates, strict=True)]
    assert result["ratio_median"] == round(statistics.median(ratios), 3)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_random_workload_stays_below_the_vocabulary(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    args = serve.build_parser().parse_args(["--num-prompts", "20", "--input-len", "8"])
    args.range_ratio = 0.5
    requests = serve.random_workload(args, str(tmp_path))
    assert len(requests) == 20
    assert all(3 <= t < 50 for r in requests for t in r.prompt)
    assert {len(r.prompt) for r in requests} <= set(range(4, 13))
    assert len({len(r.prompt) for r in requests}) > 1  # lengths vary by ±range_ratio
    assert serve.random_workload(args, str(tmp_path)) == requests  # seeded


def test_shape_and_model_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--shape", "tiny3", "--model", "/ckpt"])
