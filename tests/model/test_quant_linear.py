"""GGUF-quantized linears and embeddings (csrc/quant_linear.c) against their dequantized fp32
references, on random blocks of every kept type.

Tolerance: the kernel quantizes each block of 32 activations to 8 bits (dx = max|x| / 127,
round to nearest), so each x_k is off by at most dx / 2, and an output y_j by at most
sum_k |w_jk| dx(k) / 2 (plus fp32 rounding). The tests check that bound against the true fp32
product, and that with the same activation rounding done in torch the results agree to fp32
rounding (the integer arithmetic itself is exact).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conveyor.config import EngineConfig
from conveyor.model.cpu.quant_linear import (
    GEMM_ROWS,
    MAX_TILE,
    QUANT_TYPES,
    QuantEmbedding,
    QuantLinear,
    QuantTensor,
    quantized_module,
    set_activation_passes,
)

# Where each type's float16 scales sit in its block (d, and Q4_1's m or a K-quant's dmin),
# and their range: a K-quant's weight is d times a 6- or 8-bit sub-block scale times q.
_SCALES = {"Q4_1": (0, 2, 0.05), "Q4_K": (0, 2, 0.002), "Q5_K": (0, 2, 0.002)}
_SCALES["Q6_K"] = (208, 1, 0.0005)


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> QuantTensor:
    """Random quants (and K-quant sub-block scales) with small random float16 scales (MXFP4:
    E8M0 scales 2^-10 .. 2^-4, its values up to 6 times that)."""
    rng = np.random.default_rng(seed)
    _, weights, size = QUANT_TYPES[qtype]
    nb = cols // weights
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    if qtype == "MXFP4":
        blocks[:, :, 0] = rng.integers(118, 125, (rows, nb), dtype=np.uint8)
        return QuantTensor(qtype, torch.from_numpy(blocks.reshape(rows, nb * size)), (rows, cols))
    at, count, scale = _SCALES.get(qtype, (0, 1, 0.05))
    scales = rng.uniform(-scale, scale, (rows, nb, count)).astype(np.float16)
    blocks[:, :, at : at + 2 * count] = scales.view(np.uint8).reshape(rows, nb, 2 * count)
    data = torch.from_numpy(blocks.reshape(rows, nb * size).copy())
    return QuantTensor(qtype, data, (rows, cols))


def width(qtype: str, k: int) -> int:
    """k rounded up to whole blocks of qtype (256 for the K-quants)."""
    size = QUANT_TYPES[qtype][1]
    return -(-k // size) * size


def assert_same_up_to_fp32_order(got, xq, w, bias=0.0):
    """got == xq @ w.T + bias up to fp32 rounding of a differently ordered sum: a relative
    error of 1e-5 of the sum of |terms| (a cancelling sum may lose all its relative digits)."""
    want = xq @ w.T + bias
    scale = xq.abs() @ w.abs().T + torch.as_tensor(bias).abs()
    assert torch.all((got - want).abs() <= 1e-5 * scale + 1e-6), (got - want).abs().max()


def _round_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (blocks * inv).round() * d, d


def quantize_like_the_kernel(x: torch.Tensor, passes: int = 2) -> torch.Tensor:
    """x with each block of 32 rounded to 8 bits as csrc/quant_linear.c does (a second pass:
    the first's rounding error, rounded the same way)."""
    return _quantize(x, passes)[0]


def _quantize(x: torch.Tensor, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rounded x, each element's largest rounding error: half the last pass's step)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    first, d = _round_blocks(blocks)
    if passes == 2:
        second, d = _round_blocks(blocks - first)
        first = first + second
    return first.reshape(x.shape), (d / 2).expand_as(blocks).reshape(x.shape)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 40, 64), (5, 200, 576), (6, 24, 64), (7, 9, 96), (33, 17, 96)]
)
def test_quant_linear_matches_its_dequantized_weight(kernels, qtype, rows, n, k, passes):
    k = width(qtype, k)
    weight = random_blocks(qtype, n, k, seed=rows + n)
    w = weight.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    bias = nn.Parameter(torch.randn(n), requires_grad=False)
    layer = QuantLinear([weight], bias, kernels, passes=passes)
    with torch.inference_mode():
        got = layer(x)
        exact = x @ w.T + bias
    if layer.gemm_rows is not None and rows >= layer.gemm_rows:  # the dequantized GEMM
        assert_same_up_to_fp32_order(got, x, w, bias)
        return
    xq, half_step = _quantize(x, passes)
    assert_same_up_to_fp32_order(got, xq, w, bias)
    bound = half_step @ w.abs().T  # the activation rounding's worst case
    assert torch.all((got - exact).abs() <= bound * 1.001 + 2e-5)
    if passes == 2:  # two passes: about 254x closer to fp32 than one
        assert (got - exact).abs().max() < 0.05 * (x.abs().max() / 254 * w.abs().sum(1).max())


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels, qtype, passes):
    """The kernel takes several activation rows per pass over a weight group: each row's
    output is bit for bit the one it gets alone (a decode step's batch does not change it)."""
    k = width(qtype, 96)
    layer = QuantLinear([random_blocks(qtype, 19, k, seed=3)], None, kernels, passes=passes)
    x = torch.randn(GEMM_ROWS - 1, k, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 33])
def test_tiles_of_activation_rows_match_one_row_at_a_time_and_the_reference(
    kernels, qtype, rows, passes
):
    """The kernels take up to MAX_TILE activation rows per pass over a weight group's unpacked
    quants (odd counts leave remainder tiles of 1 to 3 rows): the same integer sums and float
    operations per row as one row at a time (max_tile 1), so the results are equal bit for
    bit, and within the activation rounding's bound of the float32 product. 40 weight rows:
    two groups of sixteen and a padded one."""
    k = width(qtype, 320)
    weight = random_blocks(qtype, 40, k, seed=11 + rows)
    w = weight.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    tiled = QuantLinear([weight], None, kernels, passes=passes)
    single = QuantLinear([weight], None, kernels, passes=passes)
    single.max_tile = 1
    assert tiled.max_tile == MAX_TILE > 1
    with torch.inference_mode():
        got, one_by_one, exact = tiled(x), single(x), x @ w.T
    assert torch.equal(got, one_by_one)
    xq, half_step = _quantize(x, passes)
    assert_same_up_to_fp32_order(got, xq, w)
    assert torch.all((got - exact).abs() <= (half_step @ w.abs().T) * 1.001 + 2e-5)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_a_long_prefill_takes_the_integer_kernels_where_they_tile(kernels, qtype):
    """On AVX-512 without BF16 the kernels beat the dequantized float32 GEMM at every row
    count, so a prefill of GEMM_ROWS or more rows stays on them: each row bit for bit what it
    gets alone. Other builds switch to a GEMM from GEMM_ROWS rows (tests below)."""
    k = width(qtype, 96)
    layer = QuantLinear([random_blocks(qtype, 21, k, seed=4)], None, kernels)
    if kernels.linear_isa != "avx512":
        assert layer.gemm_rows == GEMM_ROWS
        return
    assert layer.gemm_rows is None
    x = torch.randn(GEMM_ROWS + 44, k, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        together = layer(x)
        for i in (0, 1, 255, 256, 299):
            assert torch.equal(layer(x[i : i + 1]), together[i : i + 1]), i


def test_a_prefill_gemm_slices_the_weight_and_adds_the_bias(kernels, monkeypatch):
    """Where the kernels take one activation row at a time (AVX2, portable), a long prefill
    dequantizes the weight by slices into a float32 GEMM."""
    import conveyor.model.cpu.quant_linear as ql

    monkeypatch.setattr(ql, "_GEMM_SLICE", 24)  # 3 slices of 24 weight rows and one of 8
    parts = [random_blocks("Q4_K", 48, 256, 1), random_blocks("Q8_0", 32, 256, 2)]
    w = torch.cat([p.dequantize() for p in parts])
    bias = nn.Parameter(torch.randn(80), requires_grad=False)
    x = torch.randn(GEMM_ROWS + 5, 256, generator=torch.Generator().manual_seed(3))
    layer = QuantLinear(parts, bias, kernels)
    layer.gemm_rows = GEMM_ROWS  # the path of a build whose kernels take one row at a time
    layer._bf16_gemm = None  # (an AVX512-BF16 build's GEMM is the next test's)
    with torch.inference_mode():
        got = layer(x)
    assert_same_up_to_fp32_order(got, x, w, bias)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


@pytest.mark.parametrize("slice_bytes", [16 << 20, 1])
def test_a_long_prefill_with_avx512_bf16_runs_the_bf16_gemm_on_dequantized_panels(
    kernels, monkeypatch, slice_bytes
):
    """With AVX512-BF16, GEMM_ROWS rows or more take csrc/quant_gemm.c: every piece's groups
    of sixteen rows dequantized into bf16 panels (a slice of them per GEMM call; 1 byte: one
    group a call) and multiplied by the vdpbf16ps GEMM. Its result is the bf16 CpuLinear's on
    the file's dequantized weight, bit for bit (the same panels, the same sums), and that of
    x and W rounded to bf16 in float32 up to summation order; every type, a bias, a piece
    whose row count is not a multiple of sixteen, and widths of whole 32-weight blocks that
    are not whole K-quant super-blocks."""
    import conveyor.model.cpu.quant_linear as ql
    from conveyor.model.cpu.linear import CpuLinear

    if kernels.linear_isa != "avx512-bf16":  # (the float32 GEMM's test above, or none)
        assert QuantLinear([random_blocks("Q8_0", 16, 32, 0)], None, kernels)._bf16_gemm is None
        return

    monkeypatch.setattr(ql, "_PANEL_SLICE_BYTES", slice_bytes)
    for k, types in ((512, list(QUANT_TYPES)), (96, ["Q8_0", "Q4_0", "Q4_1"])):
        parts = [random_blocks(t, 16 * i + 7, k, i) for i, t in enumerate(types, 1)]
        w = torch.cat([p.dequantize() for p in parts])
        n = w.shape[0]
        bias = nn.Parameter(torch.randn(n), requires_grad=False)
        x = torch.randn(GEMM_ROWS + 3, k, generator=torch.Generator().manual_seed(k))
        layer = QuantLinear(parts, bias, kernels)
        assert layer.gemm_rows == GEMM_ROWS
        with torch.inference_mode():
            got = layer(x)
            dense = CpuLinear(w, bias, kernels, weight_dtype=torch.bfloat16)(x)
            short = layer(x[:5])  # fewer rows: the integer kernels
        assert torch.equal(got, dense)
        assert_same_up_to_fp32_order(got, _bf16(x), _bf16(w), bias)
        assert not torch.equal(short, got[:5])  # (two 8-bit passes, not bf16)


def test_a_fused_weight_of_mixed_types_stacks_its_pieces_in_order(kernels):
    # Q4_K_M's shape of a fused qkv: Q4_K q and k, a Q6_K v; and the 32-weight types.
    types = ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q4_1", "Q5_K"]
    parts = [random_blocks(t, 16 * (i + 1), 256, i) for i, t in enumerate(types)]
    w = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = QuantLinear(parts, None, kernels)(x.view(3, 1, 256))
    assert got.shape == (3, 1, 336)
    assert_same_up_to_fp32_order(got.view(3, 336), quantize_like_the_kernel(x), w)


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_quant_embedding_rows_equal_the_dequantized_rows_and_its_head_is_tied(kernels, qtype):
    k = width(qtype, 64)
    weight = random_blocks(qtype, 50, k, seed=7)
    emb = QuantEmbedding(weight, kernels)
    ids = torch.tensor([[3, 0], [49, 3]])
    w = weight.dequantize()
    assert torch.equal(emb(ids), w[ids])  # the same float ops as gguf's dequantizer
    head = emb.as_linear()
    assert head.qweight0.data_ptr() == emb.qweight.data_ptr()  # the same bytes, no copy
    hidden = torch.randn(4, k)
    assert_same_up_to_fp32_order(head(hidden), quantize_like_the_kernel(hidden), w)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 50\)"):
        emb(torch.tensor([50]))


def test_mxfp4_scales_decode_as_ggufs_at_every_e8m0_byte(kernels):
    """MXFP4's scale byte e is 2^(e - 128) against the doubled E2M1 values (a subnormal float
    for e < 2, 2^127 for 255). Rows dequantize (the plain C decoding every build runs) to
    gguf's reference bit for bit at all 256 bytes; the dot products' vector decoding of
    sixteen (AVX-512) or eight (AVX2) scales at once gives each block alone (x ones over it,
    scaled down by 2^-20 for e >= 128 so that no sum overflows) to float32 rounding, and to
    the subnormals' rounding at e < 2."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (16, 16, 17), dtype=np.uint8)  # 16 rows of 16 blocks
    blocks[:, :, 0] = np.arange(256, dtype=np.uint8).reshape(16, 16).T  # block b: 16 b + row
    weight = QuantTensor("MXFP4", torch.from_numpy(blocks.reshape(16, -1)), (16, 512))
    with np.errstate(over="ignore"):  # gguf's reference reaches infinity at e = 255
        w = weight.dequantize()
    assert torch.equal(QuantEmbedding(weight, kernels)(torch.arange(16)), w)
    x = torch.zeros(16, 512, dtype=torch.float64)
    for b in range(16):  # activation row b: block b of every weight row
        x[b, 32 * b : 32 * b + 32] = 1.0 if b < 8 else 2.0**-20
    with torch.inference_mode():
        got = QuantLinear([weight], None, kernels)(x.float()).double()
    # each block's sum in float64, from its bytes (past float32's range at the top)
    kvalues = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12.0]).double()
    qs = torch.from_numpy(blocks[:, :, 1:]).long()
    sums = kvalues[torch.cat([qs & 15, qs >> 4], -1)].sum(-1)  # [row, block]
    scales = torch.exp2(torch.from_numpy(blocks[:, :, 0]).double() - 128)
    want = (sums * scales).T * x[:, ::32].diagonal().view(16, 1)  # [activation row, row]
    assert torch.all((got - want).abs() <= 1e-5 * want.abs() + 2.0**-130), (got - want).abs()
    assert want[0].abs().min() > 0  # the subnormal scales' blocks are not all zero


def test_quantized_module_checks_the_shape_and_x(kernels):
    with pytest.raises(ValueError, match=r"expected \(40, 64\)"):
        quantized_module(nn.Linear(64, 40), [random_blocks("Q8_0", 41, 64, 0)], kernels)
    with pytest.raises(ValueError, match="needs uint8 rows of 68 bytes"):
        QuantTensor("Q8_0", torch.zeros(2, 60, dtype=torch.uint8), (2, 64))
    with pytest.raises(ValueError, match="Q4_K rows hold blocks of 256, got 288 columns"):
        QuantTensor("Q4_K", torch.zeros(2, 162, dtype=torch.uint8), (2, 288))
    lin = quantized_module(nn.Linear(64, 40), [random_blocks("Q8_0", 40, 64, 0)], kernels)
    with pytest.raises(ValueError, match=r"QuantLinear takes float32 CPU \[\.\.\., 64\]"):
        lin(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert lin(torch.zeros(0, 64)).shape == (0, 40)


def test_activation_passes_are_one_or_two(kernels):
    model = nn.Sequential(QuantLinear([random_blocks("Q8_0", 8, 64, 0)], None, kernels))
    set_activation_passes(model, 1)
    assert model[0].passes == 1
    with pytest.raises(ValueError, match="quant_activation_passes must be 1 or 2, got 3"):
        set_activation_passes(model, 3)
    with pytest.raises(ValueError, match="quant_activation_passes"):
        EngineConfig(quant_activation_passes=0)


@pytest.mark.parametrize("type_id, k", [(99, 64), (8, 48), (12, 288)])
def test_every_c_entry_refuses_a_type_or_width_it_does_not_handle(kernels, type_id, k):
    """The C entry points' one shape check (quant_types.c's quant_type_of): an unknown type,
    a Q8_0 width that is not whole blocks of 32, a Q4_K width that is not whole super-blocks
    of 256; each returns 1 and writes nothing."""
    w = torch.zeros(4096, dtype=torch.uint8)
    out = torch.full((2, k), 7.0)
    ids = torch.zeros(2, dtype=torch.int64)
    fns = kernels.fns
    rows = fns["rows_gguf_f32"]
    assert rows(type_id, w.data_ptr(), 64, 16, k, ids.data_ptr(), 2, out.data_ptr(), k, 1) == 1
    xq = torch.zeros(4096, dtype=torch.uint8)
    tiled = fns["gemm_gguf_q8a"]
    args = (type_id, w.data_ptr(), 64, 16, k, xq.data_ptr(), 2, 1, None, out.data_ptr(), k, 1)
    assert tiled(*args, MAX_TILE) == 1
    if kernels.linear_isa == "avx512-bf16":
        x = torch.zeros(2, k)
        gemm = fns["gemm_gguf_bf16"]
        gemm_args = (w.data_ptr(), 64, 16, k, x.data_ptr(), k, 2, None, out.data_ptr(), k)
        assert gemm(type_id, *gemm_args, 1 << 20, 1) == 1
    assert torch.all(out == 7.0)
