"""Linears with prepacked weights (our C kernel, oneDNN): the same results as nn.Linear, to
fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor import LLM, SamplingParams
from conveyor.model.cpu import cpu_build, cpu_kernels
from conveyor.model.cpu.linear import (
    CpuLinear,
    Float32Embedding,
    HeadEmbedding,
    PackedLinear,
    linear_factory,
    pack_linears,
    resolve_linear_backend,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        expected = linear(x)
        got = PackedLinear(linear.weight, linear.bias)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# 300 rows: more than one block of rows (288); K 600: three blocks of K (256); N 1000 and 7:
# a last panel of 8 and a single partial panel.
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 16, 40, 300])
@pytest.mark.parametrize(("n", "k", "bias"), [(200, 96, True), (1000, 600, False), (7, 5, True)])
def test_cpu_linear_equals_nn_linear(kernels, rows, n, k, bias):
    torch.manual_seed(rows + n)
    linear = nn.Linear(k, n, bias=bias)
    x = torch.randn(rows, k)
    with torch.inference_mode():
        expected = linear(x)
        got = CpuLinear(linear.weight, linear.bias, kernels)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _reference(x, weight, bias, round_x=False):
    """x @ weight.T + bias in float64 (x rounded to bf16 first where the kernel does)."""
    xs = x.bfloat16() if round_x else x
    out = xs.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _rounds_x(kernels) -> bool:
    """Whether this build's bf16 GEMM rounds x to bf16 (vdpbf16ps)."""
    return kernels.linear_isa == "avx512-bf16"


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 16, 40, 300])
@pytest.mark.parametrize(("n", "k", "bias"), [(200, 96, True), (1000, 600, False), (7, 5, True)])
def test_cpu_linear_with_bfloat16_weights_is_the_float32_product_of_the_rounded_operands(
    kernels, rows, n, k, bias
):
    torch.manual_seed(rows + n)
    linear = nn.Linear(k, n, bias=bias)
    x = torch.randn(rows, k)
    lin = CpuLinear(linear.weight, linear.bias, kernels, torch.bfloat16)
    assert lin.packed_weight.dtype == torch.bfloat16
    # half of float32's bytes (K rounded up to a pair)
    assert lin.packed_weight.numel() == -(-n // 16) * 16 * (k + k % 2)
    # The weights rounded to bf16 once, then float32 products and sums; x rounded to bf16
    # too where the kernel is vdpbf16ps's, never by the widening kernel.
    rounded = linear.weight.detach().bfloat16()
    with torch.inference_mode():
        got = lin(x)
        widened = kernels.linear(x, lin.packed_weight, n, lin.bias, widened=True)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    expected = _reference(x, rounded, linear.bias.detach() if bias else None, _rounds_x(kernels))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    unrounded = _reference(x, rounded, linear.bias.detach() if bias else None)
    torch.testing.assert_close(widened.double(), unrounded, rtol=1e-5, atol=1e-5)


# Shapes around every edge of the kernels: a partial last panel (N not a multiple of 16), K
# of 1, odd K (a padded pair), K across blocks of 256 with an odd rest, and rows around the
# micro-kernels' 6 and 12 and the blocks of 288. Tolerance: against the float64 sum of the
# same rounded operands, what fp32 summation of up to a thousand terms of about 1 / sqrt(K)
# each leaves (outputs about 1): 1e-5, the other linear tests' bound.
# (379, 70): six whole groups of four panels, the last panel 11 columns wide
EDGE_SHAPES = [(1, 1), (17, 3), (33, 31), (16, 2), (47, 257), (64, 513), (5, 1027), (379, 70)]
EDGE_ROWS = [1, 2, 5, 6, 7, 11, 12, 13, 25, 289, 300]


@pytest.mark.parametrize(("n", "k"), EDGE_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_every_gemm_path_against_float64_at_edge_shapes(kernels, n, k, bias, weight_dtype):
    torch.manual_seed(n * 1000 + k)
    weight = torch.randn(n, k) / k**0.5
    b = torch.randn(n) if bias else None
    lin = CpuLinear(weight, b, kernels, weight_dtype)
    w = weight.to(weight_dtype)
    for rows in EDGE_ROWS:
        x = torch.randn(rows, k)
        with torch.inference_mode():
            got = lin(x).double()
        round_x = weight_dtype == torch.bfloat16 and _rounds_x(kernels)
        torch.testing.assert_close(got, _reference(x, w, b, round_x), rtol=1e-5, atol=1e-5)
        if weight_dtype == torch.bfloat16:
            widened = kernels.linear(x, lin.packed_weight, n, lin.bias, widened=True)
            want = _reference(x, w, b)
            torch.testing.assert_close(widened.double(), want, rtol=1e-5, atol=1e-5)


def test_the_bf16_gemm_rounds_x_to_nearest_even_with_vdpbf16ps_only(kernels):
    # Column 0 of W is 1: the output is x as the kernel multiplied it, for values at and near
    # the halfway points between two bf16 numbers (ties go to the even one).
    one = 1 + 2**-8  # halfway between 1 and the next bf16 above it: rounds down, to 1
    three = 1 + 3 * 2**-8  # halfway between 1 + 2^-7 and 1 + 2^-6: rounds up
    x = torch.tensor([[one], [three], [1 + 2**-8 + 2**-20], [-one], [2.0**-130]])
    lin = CpuLinear(torch.ones(1, 1), None, kernels, torch.bfloat16)
    with torch.inference_mode():
        got = lin(x)[:, 0]
        widened = kernels.linear(x, lin.packed_weight, 1, None, widened=True)[:, 0]
    assert torch.equal(widened, x[:, 0])  # the widening kernel never rounds x
    if _rounds_x(kernels):
        # the last: vdpbf16ps treats denormal inputs as zero
        assert torch.equal(got, torch.tensor([1.0, 1 + 2**-6, 1 + 2**-7, -1.0, 0.0])), got
    else:
        assert torch.equal(got, x[:, 0])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [24, 25])  # 25: bf16's padded last pair
@pytest.mark.parametrize("n", [37, 128])  # a partial last panel and group; whole groups
def test_a_packed_head_gives_back_the_embedding_rows(kernels, weight_dtype, k, n):
    torch.manual_seed(0)
    weight = torch.randn(n, k)
    head = CpuLinear(weight, None, kernels, weight_dtype)
    embed = HeadEmbedding(head)
    ids = torch.tensor([[0, 36, 8], [15, 16, 7], [n - 1, 1, n - 17]])
    rows = embed(ids)
    assert rows.dtype == torch.float32 and rows.shape == (3, 3, k)
    assert torch.equal(rows, weight.to(weight_dtype).float()[ids])
    many = torch.randint(0, n, (3000,))  # a prefill's worth: the threads share the rows
    assert torch.equal(embed(many), weight.to(weight_dtype).float()[many])
    for bad in (n, -1):
        with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {n}\)"):
            embed(torch.tensor([3, bad]))


def test_cpu_linear_rows_do_not_depend_on_their_batch_and_any_layout_works(kernels):
    torch.manual_seed(0)
    linear = nn.Linear(300, 50)
    lin = CpuLinear(linear.weight, linear.bias, kernels)
    x = torch.randn(20, 300)
    bf16 = CpuLinear(linear.weight, linear.bias, kernels, torch.bfloat16)
    with torch.inference_mode():
        for each in (lin, bf16):
            whole = each(x)
            for i in (0, 7, 13, 19):  # one sum over k in order per output: bit for bit
                assert torch.equal(each(x[i : i + 1]), whole[i : i + 1])
                assert torch.equal(each(x[i : i + 13]), whole[i : i + 13])
        wide = torch.randn(20, 310)[:, 5:305]  # rows with a stride of 310
        torch.testing.assert_close(lin(wide), linear(wide), rtol=1e-5, atol=1e-5)
        cols = torch.randn(300, 20).t()  # column-major: copied first
        torch.testing.assert_close(lin(cols), linear(cols), rtol=1e-5, atol=1e-5)
        three = torch.randn(2, 3, 300)
        torch.testing.assert_close(lin(three), linear(three), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"CpuLinear takes float32 \[\.\.\., 300\]"):
            lin(x.bfloat16())


def test_pack_linears_replaces_every_linear_and_packs_a_tied_head(kernels):
    class Inner(nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 8, dtype=dtype)
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    class Model(nn.Module):
        def __init__(self, tied: bool, dtype: torch.dtype = torch.float32) -> None:
            super().__init__()
            self.model = Inner(dtype)
            self.lm_head = None if tied else nn.Linear(8, 50)

    cases = [
        (PackedLinear, PackedLinear, torch.float32),
        (linear_factory("cpu"), CpuLinear, torch.float32),
        (linear_factory("cpu", torch.bfloat16), CpuLinear, torch.bfloat16),
    ]
    for make, kind, dtype in cases:
        model = Model(tied=True, dtype=dtype)
        embedding = model.model.embed_tokens.weight.detach().clone()
        assert pack_linears(model, make) == 3
        assert not any(type(m) is nn.Linear for m in model.modules())
        assert isinstance(model.lm_head, kind) and isinstance(model.model.layers[0], kind)
        hidden = torch.randn(4, 8)
        ids = torch.tensor([0, 49, 17])
        with torch.inference_mode():
            logits = model.lm_head(hidden)
            looked_up = model.model.embed_tokens(ids)
        if dtype == torch.bfloat16 and _rounds_x(kernels):  # vdpbf16ps: x rounded too
            hidden = hidden.bfloat16().float()
        torch.testing.assert_close(logits, hidden @ embedding.float().T)
        assert torch.equal(looked_up, embedding.float()[ids])
        # Our head's panels serve the lookups too: the matrix is held once.
        assert isinstance(model.model.embed_tokens, HeadEmbedding) == (kind is CpuLinear)
    # Untied, in bf16: the embedding keeps its table and gives float32 rows.
    model = Model(tied=False, dtype=torch.bfloat16)
    table = model.model.embed_tokens.weight
    pack_linears(model, linear_factory("cpu", torch.bfloat16))
    assert isinstance(model.model.embed_tokens, Float32Embedding)
    assert model.model.embed_tokens.weight.data_ptr() == table.data_ptr()
    assert torch.equal(model.model.embed_tokens(ids), table.float()[ids])


def test_auto_takes_our_gemm_where_it_is_the_avx2_kernel_and_onednn_where_it_is_portable(
    kernels,
):
    # The CONVEYOR_CPU_ISA=portable run of this file (tests/model/test_cpu_isa.py) takes the second
    # branch on this very machine; an AVX2 CPU's default build the first.
    want = "cpu" if kernels.linear_vectorized else "onednn"
    forced = {"portable": "portable", "avx2": "avx2", "avx512": "avx512"}
    forced["avx512bf16"] = "avx512-bf16"
    if cpu_build.requested_isa() in forced:  # the GEMM each forced level builds
        assert kernels.linear_isa == forced[cpu_build.requested_isa()]
        assert kernels.linear_vectorized == (cpu_build.requested_isa() != "portable")
    assert resolve_linear_backend("auto", CPU, torch.float32) == want
    # bf16: our GEMM's bf16 weights where it is the AVX2 kernel, else torch's bf16 linears.
    want_bf16 = "cpu" if kernels.linear_vectorized else "torch"
    assert resolve_linear_backend("auto", CPU, torch.bfloat16) == want_bf16
    # Asking for "cpu" works in either build: the portable loop is slower, not wrong.
    assert resolve_linear_backend("cpu", CPU, torch.float32) == "cpu"
    assert isinstance(linear_factory("cpu")(torch.ones(3, 2), None), CpuLinear)


def test_backend_choice(monkeypatch):
    assert resolve_linear_backend("onednn", CPU, torch.float32) == "onednn"
    assert resolve_linear_backend("cpu", CPU, torch.bfloat16) == "cpu"
    with pytest.raises(ValueError, match="'cpu' runs on CPU in float32 or bfloat16"):
        resolve_linear_backend("cpu", CPU, torch.float16)
    # Without the C kernels (no compiler): auto falls back to oneDNN, and "cpu" is refused
    # by name wherever it is asked for.
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert resolve_linear_backend("auto", CPU, torch.float32) == "onednn"
    with pytest.raises(ValueError, match="linear_backend 'cpu' needs the C kernels"):
        resolve_linear_backend("cpu", CPU, torch.float32)
    with pytest.raises(ValueError, match="linear_backend 'cpu' needs the C kernels"):
        linear_factory("cpu")
    assert resolve_linear_backend("auto", CPU, torch.bfloat16) == "torch"
    monkeypatch.undo()
    assert resolve_linear_backend("auto", CPU, torch.float16) == "torch"
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    with pytest.raises(ValueError, match="runs on CPU in float32 only"):
        resolve_linear_backend("onednn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", CPU, torch.float32)


def test_cpu_onednn_and_torch_linears_give_the_same_greedy_tokens(kernels, demo_model_dir):
    prompts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("cpu", "onednn", "torch"):
        llm = LLM(str(demo_model_dir), linear_backend=backend, num_kv_blocks=64)
        assert llm.llm_engine.runner.linear_backend == backend
        runs[backend] = llm.generate(prompts, params, use_tqdm=False)
    for fast in ("cpu", "onednn"):
        for got, ref in zip(runs[fast], runs["torch"], strict=True):
            assert got.outputs[0].token_ids == ref.outputs[0].token_ids
            for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys()  # the sampled token and the top one
                for tid in a:
                    assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-4)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_long_batches_give_each_row_what_it_gets_alone(kernels, weight_dtype):
    """Rows of a long batch (prefill) go through the GEMM's wide tiles (groups of panels, rows
    eight at a time, with a remainder of rows and of panels); each output is still the one sum
    over k in order a row gets on its own, bit for bit."""
    torch.manual_seed(1)
    n, k = 16 * 7 + 5, 600  # two groups of three full panels, a full one and a partial one
    lin = CpuLinear(torch.randn(n, k) / k**0.5, torch.randn(n), kernels, weight_dtype)
    x = torch.randn(300, k)  # MC (288) rows and a rest; tiles of 8 and a rest of 4
    with torch.inference_mode():
        whole = lin(x)
        for i in (0, 7, 8, 15, 21, 287, 288, 299):
            assert torch.equal(lin(x[i : i + 1]), whole[i : i + 1]), i
        assert torch.equal(lin(x[3:24]), whole[3:24])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 3, 5, 8, 9, 12, 16])
def test_decode_sized_batches_give_each_row_what_it_gets_alone(kernels, weight_dtype, rows):
    """A decode step takes the few-row kernels over groups of four panels (the last panels one
    at a time): AVX-512 up to 16 rows four at a time, AVX2 1-3 rows (float32; bf16 1-2) one at
    a time, more rows there the 6 x 16 blocks. Each row's outputs are the ones it gets alone,
    bit for bit, and the float64 product's up to the operands' rounding."""
    torch.manual_seed(rows)
    n, k = 16 * 6 + 3, 520  # a group of four panels, then two full panels and a partial one
    weight, bias = torch.randn(n, k) / k**0.5, torch.randn(n)
    lin = CpuLinear(weight, bias, kernels, weight_dtype)
    x = torch.randn(rows, k)
    with torch.inference_mode():
        whole = lin(x)
        for i in range(rows):
            assert torch.equal(lin(x[i : i + 1]), whole[i : i + 1]), i
    w = weight.to(weight_dtype).double()
    xr = (
        x.bfloat16().double()
        if kernels.linear_isa == "avx512-bf16" and weight_dtype == torch.bfloat16
        else x.double()
    )
    want = xr @ w.T + bias.double()
    torch.testing.assert_close(whole.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("panels", [7, 8, 13])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_panels_are_stored_four_to_a_group_line_by_line(kernels, weight_dtype, panels):
    """The packed weight: panels of 16 columns, in groups of four stored line by line (line q
    of each of the group's panels, then line q + 1), the last group the panels left over; a
    line one k of float32 or one pair of k of bf16. A decode step reads a group as one stream.
    In bf16 on a vdpbf16ps build, with an odd number of whole groups (7 panels: one, 13:
    three) the middle one is stored as two groups of two, so that two threads splitting the
    groups by halves each read one."""
    n, k = 16 * (panels - 1) + 3, 6  # the last panel partial
    weight = torch.arange(n * k, dtype=torch.float32).view(n, k)  # exact in bf16 below 256
    weight = weight % 251
    packed = CpuLinear(weight, None, kernels, weight_dtype).packed_weight
    w = weight.to(weight_dtype)
    pairs = weight_dtype == torch.bfloat16
    lines = k // 2 if pairs else k
    assert packed.shape[0] == panels * lines
    whole = panels // 4
    split = pairs and kernels.linear_isa == "avx512-bf16"
    for p in range(panels):
        group = p // 4
        if group == whole:  # the panels left over
            first, slot, size = 4 * whole * lines, p % 4, panels - 4 * whole
        elif split and whole % 2 and group == whole // 2:  # the middle group, as two pairs
            first, slot, size = (4 * group + p % 4 // 2 * 2) * lines, p % 2, 2
        else:
            first, slot, size = 4 * group * lines, p % 4, 4
        for q in range(lines):
            line = packed[first + q * size + slot]
            cols = torch.arange(16 * p, min(16 * p + 16, n))
            if pairs:  # column j's k = 2q and 2q + 1 side by side
                assert torch.equal(line[: len(cols)], w[cols][:, 2 * q : 2 * q + 2]), (p, q)
            else:
                assert torch.equal(line[: len(cols)], w[cols, q]), (p, q)
            assert not line[len(cols) :].any()  # the partial panel's zero columns
    # the C side reads the same layout: every row back (a tied head's embedding lookup)
    rows = kernels.linear_rows(packed, n, k, torch.arange(n))
    assert torch.equal(rows, w.float())


@pytest.mark.parametrize("rows", [1, 5, 70, 300])
def test_the_bf16_gemm_gives_the_same_bits_on_panels_one_to_a_group(kernels, rows):
    """quant_gemm.c hands the vdpbf16ps GEMM panels one to a group (GGUF prefill's dequantized
    slices): on them the same weights give the same outputs, bit for bit, as CpuLinear's
    groups of four, on every path (decode groups, single panels, prefill tiles); builds
    without it take the group argument through the widening GEMM."""
    import ctypes

    torch.manual_seed(rows)
    n, k = 16 * 9 + 5, 131  # groups of four, a partial last group, an odd K
    weight, bias = torch.randn(n, k) / k**0.5, torch.randn(n)
    lin = CpuLinear(weight, bias, kernels, torch.bfloat16)
    padded = torch.zeros(160, k + 1, dtype=torch.bfloat16)
    padded[:n, :k] = weight.bfloat16()
    flat = padded.view(10, 16, (k + 1) // 2, 2).transpose(1, 2).contiguous()  # [P, K/2, 16, 2]
    x = torch.randn(rows, k)
    out = torch.empty(rows, n)
    grouped = kernels.fns.get("gemm_bf16_bf16_grouped", kernels.fns["gemm_bf16_f32_grouped"])
    grouped(
        x.data_ptr(), k, rows, flat.data_ptr(), n, k, bias.data_ptr(), out.data_ptr(), n,
        torch.get_num_threads(), ctypes.c_int32(1),
    )  # fmt: skip
    with torch.inference_mode():
        assert torch.equal(out, lin(x))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
# odd groups; a tail; whole groups only, the last panel narrower
@pytest.mark.parametrize("n", [16 * 4 * 9, 16 * 4 * 9 + 16 * 3 - 5, 16 * 4 * 8 - 5])
def test_a_decode_step_gives_the_same_bits_on_one_thread_or_several(kernels, weight_dtype, n):
    """A few rows split the panels between the threads by halves of groups (an odd number of
    groups does not leave one thread a group more): whichever thread reads a panel, and
    whether as a whole group, a half or the tail, each output is the same sum."""
    torch.manual_seed(n)
    k = 200
    lin = CpuLinear(torch.randn(n, k) / k**0.5, torch.randn(n), kernels, weight_dtype)
    x = torch.randn(16, k)
    saved = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                got[threads] = [lin(x[:rows]) for rows in (1, 3, 4, 5, 16)]
    finally:
        torch.set_num_threads(saved)
    for threads in (2, 3):
        for a, b in zip(got[1], got[threads], strict=True):
            assert torch.equal(a, b), threads
