"""benchmarks/serve_peers.py runs end to end without any peer installed (speed is not
checked): conveyor serve and a second side given as a command (conveyor again, standing in
for a peer) on the demo model, with the ratios and the memory split reported."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from conveyor.load_client.sibling import load_sibling

pytestmark = pytest.mark.slow  # runs a benchmark script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
peers = load_sibling(str(BENCHMARKS / "serve_peers.py"), "serve_peers")


@pytest.mark.slow  # four server starts
def test_serve_peers_runs_each_side_interleaved_and_reports_ratios(demo_model_dir) -> None:
    ours = shlex.join(peers.serve_bench.conveyor_command())
    stand_in = f"{ours} serve --model {{model}} --port {{port}} --max-num-seqs {{streams}}"
    argv = ["--model", str(demo_model_dir), "--side", f"stand-in={stand_in}"]
    argv += ["--streams", "2", "--num-prompts", "3", "--input-len", "6", "--output-len", "4"]
    argv += ["--repeats", "2", "--conveyor-flags", "--num-kv-blocks 64"]
    report = peers.main(argv)
    (entry,) = report["runs"]
    for side in ("conveyor", "stand-in"):
        assert entry[side]["successful"] == 3 and entry[side]["failed"] == 0
        assert len(entry[side]["all_output_tok_s"]) == 2
        assert entry[side]["rss_mib"] > 0
    # weights and KV cache from the start-up log of each side that is a conveyor server
    for side in ("conveyor", "stand-in"):
        assert entry[side]["kv_mib"] > 0 and entry[side]["weights_mib"] > 0
        want = entry[side]["rss_mib"] - entry[side]["weights_mib"] - entry[side]["kv_mib"]
        assert entry[side]["runtime_mib"] == pytest.approx(want, abs=0.2)
    assert set(entry["ratios_conveyor_to"]) == {"stand-in"}
    ratio = entry["ratios_conveyor_to"]["stand-in"]["output_tok_s"]
    want = entry["conveyor"]["output_tok_s"] / entry["stand-in"]["output_tok_s"]
    assert ratio == pytest.approx(want, abs=1e-3)


def test_a_side_needs_a_new_name_and_a_command() -> None:
    with pytest.raises(SystemExit, match="NAME=COMMAND"):
        peers.main(["--model", "m", "--side", "conveyor=x serve"])
    with pytest.raises(SystemExit, match="NAME=COMMAND"):
        peers.main(["--model", "m", "--side", "nocommand"])


def test_prompts_are_fresh_for_each_seed() -> None:
    a, b = peers.prompts(4, 10, 8, seed=1), peers.prompts(4, 10, 8, seed=2)
    assert a == peers.prompts(4, 10, 8, seed=1)
    assert not {r.prompt for r in a} & {r.prompt for r in b}
    assert all(r.max_tokens == 8 and len(r.prompt.split()) == 11 for r in a)
