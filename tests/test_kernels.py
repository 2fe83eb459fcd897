"""The Triton kernels (kernels/) against the PyTorch reference (msds.multilevel.tensor_ops), on the
CPU under the Triton interpreter: every grouping kind, every dtype, odd sizes and small tiles so
that tile edges are everywhere, outputs poisoned with NaN (and framed by NaN to catch writes past
the masks), and tensor_ops' backend choice: its errors and PyTorch fallback."""
import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: it is the optional extra 'kernels' (pip install 'msds[kernels]')",
                allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":     # triton reads it on import: tests/conftest.py sets it
    pytest.skip("the kernels run on the CPU only under TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import multilevel  # noqa: E402

from msds.errors import MsdsError  # noqa: E402
from msds.multilevel import backends  # noqa: E402
from msds.multilevel.grouping import Grouping  # noqa: E402
from msds.multilevel.operators import tensor_scale  # noqa: E402
from msds.multilevel.tensor_ops import (coalesce_tensor, decoalesce_interpolate_tensor,  # noqa: E402
                                        decoalesce_tensor)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def interpreting(monkeypatch):
    """backend='triton' runs CPU tensors only while TRITON_INTERPRET is set."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
SMALL_TILE = (4, 8)          # many programs and partial tiles on every edge of the shapes below

# (grouping, channels per unit): every layout, shards, explicit groups, blocks (heads), factor 3 and 4.
GROUPINGS = {
    "none": (None, 1),
    "adjacent": (Grouping(6, 2, "adjacent"), 1),
    "strided_shards": (Grouping(8, 2, "strided", shards=2), 1),
    "strided_g4_blocks": (Grouping(4, 4, "strided"), 3),
    "explicit_g3": (Grouping.from_groups([[0, 3, 5], [1, 2, 4]], 6, "test"), 1),
    "adjacent_blocks": (Grouping(4, 2, "adjacent", shards=2), 5),
}
ROW_COL_CASES = [("adjacent", "strided_shards"), ("strided_g4_blocks", "none"), ("none", "explicit_g3"),
                 ("explicit_g3", "adjacent_blocks"), ("adjacent_blocks", "strided_g4_blocks")]


def _large_size(name: str) -> int:
    grouping, block = GROUPINGS[name]
    return (grouping.units if grouping else 7) * block       # 7: an odd ungrouped axis


def _axes(rows, cols):
    return [(d, g) for d, g in ((0, rows), (1, cols)) if g is not None]


def _members(rows, cols, large_shape):
    """The kernels' coalesce maps of a large matrix, as msds builds them."""
    return (backends.member_index(rows, large_shape[0], torch.device("cpu")),
            backends.member_index(cols, large_shape[1], torch.device("cpu")))


def _owners(rows, cols, large_shape):
    """The kernels' de-coalesce maps of a large matrix, as msds builds them."""
    return (backends.owner_index(rows, large_shape[0], torch.device("cpu")),
            backends.owner_index(cols, large_shape[1], torch.device("cpu")))


def _framed_nan(shape, dtype):
    """A NaN-filled view of `shape` inside a NaN frame: unwritten elements stay NaN, writes past
    the masks land in the frame."""
    frame = torch.full((shape[0] + 2, shape[1] + 3), float("nan"), dtype=dtype)
    return frame, frame[1:1 + shape[0], 2:2 + shape[1]]


def _assert_frame_untouched(frame, shape):
    inner = torch.zeros_like(frame, dtype=torch.bool)
    inner[1:1 + shape[0], 2:2 + shape[1]] = True
    assert frame[~inner].isnan().all(), "a kernel wrote outside its output"


def _tolerance(dtype, magnitude: float):
    """Coalescing rounds once where the reference rounds per step: two ulps of the dtype, relative
    to the inputs' magnitude (a mean of mixed signs can cancel)."""
    eps = torch.finfo(dtype).eps
    return {"rtol": 2 * eps, "atol": 2 * eps * magnitude}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row_name,col_name", ROW_COL_CASES)
def test_coalesce_kernel_matches_reference(row_name, col_name, dtype):
    torch.manual_seed(0)
    rows, cols = GROUPINGS[row_name][0], GROUPINGS[col_name][0]
    t = torch.randn(_large_size(row_name), _large_size(col_name)).to(dtype)
    for scale in (1.0, 4.0, 3.0):
        reference = coalesce_tensor(t, _axes(rows, cols), scale, backend="torch")
        frame, out = _framed_nan(reference.shape, dtype)
        multilevel.coalesce(t, *_members(rows, cols, t.shape), scale, out=out, tile=SMALL_TILE)
        assert not out.isnan().any(), "unwritten output elements"
        _assert_frame_untouched(frame, reference.shape)
        torch.testing.assert_close(out, reference, **_tolerance(dtype, scale * t.abs().max().item()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row_name,col_name", ROW_COL_CASES)
def test_decoalesce_interpolate_kernel_is_the_reference_bit_for_bit(row_name, col_name, dtype):
    """De-coalesce, then torch.lerp with the saved tensor: the kernel equals it exactly, every
    alpha (both branches of lerp, both ends), every dtype, scales that are and are not powers of 2."""
    torch.manual_seed(1)
    rows, cols = GROUPINGS[row_name][0], GROUPINGS[col_name][0]
    large_shape = (_large_size(row_name), _large_size(col_name))
    small = torch.randn(large_shape[0] // (rows.factor if rows else 1),
                        large_shape[1] // (cols.factor if cols else 1)).to(dtype)
    saved = torch.randn(large_shape).to(dtype)
    owners = _owners(rows, cols, large_shape)
    for scale in (1.0, 2.0, 3.0):
        copies = decoalesce_tensor(small, _axes(rows, cols), scale, backend="torch")
        frame, out = _framed_nan(large_shape, dtype)
        multilevel.decoalesce(small, *owners, scale, out=out, tile=SMALL_TILE)
        assert torch.equal(out, copies)
        _assert_frame_untouched(frame, large_shape)
        for alpha in (0.0, 0.25, 0.5, 0.7, 1.0):
            frame, out = _framed_nan(large_shape, dtype)
            multilevel.decoalesce(small, *owners, scale, saved=saved, alpha=alpha, out=out, tile=SMALL_TILE)
            _assert_frame_untouched(frame, large_shape)
            assert torch.equal(out, torch.lerp(saved, copies, alpha)), f"alpha {alpha}, scale {scale}"
        assert torch.equal(out, copies)                        # alpha = 1: pure de-coalescing


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_tiles_strided_inputs_and_copies_round_trip(dtype):
    """Default tiles with odd sizes, non-contiguous inputs, and coalesce(decoalesce(x)) == x bit for
    bit (means of copies are exact, the in-side scale is a power of 2)."""
    torch.manual_seed(2)
    rows, cols = Grouping(10, 2, "strided", shards=5), Grouping(9, 3, "adjacent")
    small = torch.randn(27, 35).to(dtype).t()                 # (35, 27): 5 units of 7 rows, 3 of 9 cols
    large = multilevel.decoalesce(small, *_owners(rows, cols, (70, 81)), 2.0)
    assert torch.equal(large, decoalesce_tensor(small, [(0, rows), (1, cols)], 2.0, backend="torch"))
    back = multilevel.coalesce(large.t().contiguous().t(), *_members(rows, cols, (70, 81)), 2.0)
    assert torch.equal(back, small)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_values_pass_through(dtype):
    """Non-finite values travel like the reference's (NaN stays NaN, inf stays inf)."""
    values = torch.tensor([[1.0, float("nan")], [float("inf"), -float("inf")], [3.0, 1e-3]]).to(dtype)
    out = multilevel.decoalesce(values, *_owners(None, None, (3, 2)), 1.0)
    assert torch.equal(out.isnan(), values.isnan()) and torch.equal(out.isinf(), values.isinf())
    coalesced = multilevel.coalesce(values, *_members(None, None, (3, 2)), 1.0)
    assert torch.equal(coalesced.nan_to_num(), values.nan_to_num())


@pytest.mark.parametrize("call,match", [
    (lambda: multilevel.coalesce(torch.randn(4, 4), *_members(None, None, (4, 3)), 1.0),
     r"col_members: lists 3 channels, t has 4"),
    (lambda: multilevel.coalesce(torch.randn(4), *_members(None, None, (4, 1)), 1.0), r"t: expected a 2-D"),
    (lambda: multilevel.coalesce(torch.randn(4, 1).double(), *_members(None, None, (4, 1)), 1.0),
     r"t: dtype torch.float64 has no kernel"),
    (lambda: multilevel.coalesce(torch.randn(4, 1), torch.zeros(4, 1, dtype=torch.int64),
                                 torch.zeros(1, 1, dtype=torch.int32), 1.0), r"row_members: expected a 2-D int32"),
    (lambda: multilevel.decoalesce(torch.randn(2, 2), *_owners(None, None, (2, 2)), 1.0,
                                   saved=torch.randn(2, 3)), r"saved: expected shape \(2, 2\)"),
    (lambda: multilevel.decoalesce(torch.randn(2, 2), *_owners(None, None, (2, 2)), 1.0,
                                   out=torch.empty(2, 2).half()), r"out: expected shape \(2, 2\), torch.float32"),
])
def test_kernel_launchers_refuse_bad_arguments(call, match):
    """The kernels check what they are handed (ValueError): a wrong map would read out of bounds."""
    with pytest.raises(ValueError, match=match):
        call()


# --- tensor_ops' backends ------------------------------------------------------------------------

def _both(operator, *args, **kwargs):
    return operator(*args, **kwargs, backend="triton"), operator(*args, **kwargs, backend="torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_and_torch_backends_agree(dtype):
    torch.manual_seed(3)
    heads = Grouping(4, 2, "strided", shards=2)               # blocks of 3 rows (q, k, v of a head)
    hidden = Grouping(10, 2, "adjacent")
    weight = torch.randn(12, 10).to(dtype)
    bias = torch.randn(12).to(dtype)
    tol = _tolerance(dtype, 2 * weight.abs().max().item())

    got, want = _both(coalesce_tensor, weight, [(0, heads), (1, hidden)], hidden.factor)   # columns summed
    torch.testing.assert_close(got, want, **tol)
    got, small_bias = _both(coalesce_tensor, bias, [(0, heads)])
    torch.testing.assert_close(got, small_bias, **tol)
    got, want = _both(decoalesce_tensor, small_bias, [(0, heads)])
    assert got.shape == (12,) and torch.equal(got, want)
    got, want = _both(decoalesce_interpolate_tensor, small_bias, bias, 0.5, [(0, heads)])
    assert torch.equal(got, want)
    got, want = _both(decoalesce_tensor, weight[:6, :5], [(0, heads), (-1, hidden)], 2.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moments_take_the_scales_of_the_one_rule(dtype):
    """exp_avg scales by c, exp_avg_sq by c^2 (operators.tensor_scale), both ways, on the kernels."""
    torch.manual_seed(4)
    rows, cols = Grouping(6, 2, "strided"), Grouping(4, 2, "adjacent")
    sides = [(0, rows, "out"), (1, cols, "in")]
    axes = [(0, rows), (1, cols)]
    for kind, moment in (("exp_avg", torch.randn(6, 8).to(dtype)), ("exp_avg_sq", torch.rand(6, 8).to(dtype))):
        scale = tensor_scale(sides, 1, kind)
        assert scale == {"exp_avg": 2, "exp_avg_sq": 4}[kind]
        small = coalesce_tensor(moment, axes, scale, backend="triton")
        torch.testing.assert_close(small, coalesce_tensor(moment, axes, scale, backend="torch"),
                                   **_tolerance(dtype, scale * moment.abs().max().item()))
        large = decoalesce_interpolate_tensor(small, moment, 0.25, axes, scale, backend="triton")
        assert torch.equal(large, torch.lerp(moment, decoalesce_tensor(small, axes, scale, backend="torch"), 0.25))


def test_kernels_take_tensor_ops_shapes():
    """2-D, 1-D and a depth stack (dim 0 of a 3-D tensor) run on the kernels; CPU tensors under
    `auto` and axes that do not fit the kernels' matrix take PyTorch."""
    torch.manual_seed(5)
    rows, cols = Grouping(6, 2, "strided"), Grouping(4, 2, "adjacent")
    layers = Grouping(4, 2, "adjacent")
    cases = [(torch.randn(6, 8), [(0, rows), (-1, cols)]), (torch.randn(12), [(0, rows)]),
             (torch.randn(4, 6, 8), [(0, layers)])]
    assert not backends.use_kernels(cases[0][0], cases[0][1], "auto")            # CPU: PyTorch path
    for t, axes in cases:
        torch.testing.assert_close(coalesce_tensor(t, axes, 2.0, backend="triton"),
                                   coalesce_tensor(t, axes, 2.0, backend="torch"), rtol=1e-6, atol=1e-6)
        small = coalesce_tensor(t, axes)
        assert torch.equal(decoalesce_tensor(small, axes, 4.0, backend="triton"),
                           decoalesce_tensor(small, axes, 4.0, backend="torch"))
    middle = [(1, rows)]
    assert backends.matrix_groupings(torch.randn(4, 6, 8), middle) is None
    with pytest.raises(MsdsError, match=r"t: its grouped dims \[1\] do not fit the kernels' matrix view"):
        coalesce_tensor(torch.randn(4, 6, 8), middle, backend="triton")


def test_without_triton_everything_runs_on_the_pytorch_path(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    rows = Grouping(4, 2, "strided")
    t = torch.randn(4, 3)
    assert torch.equal(coalesce_tensor(t, [(0, rows)]), coalesce_tensor(t, [(0, rows)], backend="torch"))
    assert not backends.use_kernels(t, [(0, rows)], "auto")
    with pytest.raises(MsdsError, match=r"msds\[kernels\]"):
        coalesce_tensor(t, [(0, rows)], backend="triton")


@pytest.mark.parametrize("call,match", [
    (lambda: coalesce_tensor(torch.randn(7, 4), [(0, Grouping(4, 2))], backend="triton"),
     r"t axis 0: has 7 channels, not a multiple of the grouping's 4 large units"),
    (lambda: decoalesce_tensor(torch.randn(3, 4), [(1, Grouping(6, 2))], backend="torch"),
     r"t axis 1: has 4 channels, not a multiple of the grouping's 3 small units"),
    (lambda: decoalesce_interpolate_tensor(torch.randn(2, 4), torch.randn(4, 5), 0.5, [(0, Grouping(4, 2))]),
     r"saved: shape \(4, 5\) disagrees with \(4, 4\)"),
    (lambda: decoalesce_interpolate_tensor(torch.randn(2, 4), torch.randn(4, 4).half(), 0.5, [(0, Grouping(4, 2))]),
     r"saved: dtype torch.float16 disagrees with small's torch.float32; cast one"),
    (lambda: decoalesce_interpolate_tensor(torch.randn(2, 4), torch.randn(4, 4, device="meta"), 0.5,
                                           [(0, Grouping(4, 2))]),
     r"saved: is on meta, small on cpu; move both to one device"),
    (lambda: coalesce_tensor(torch.randn(4, 4), [], backend="cuda"), r"backend: 'cuda' is not one of"),
    (lambda: coalesce_tensor(torch.randn(4, 4).double(), [], backend="triton"),
     r"t: dtype torch.float64 has no kernel"),
])
def test_bad_input_is_one_clear_error(call, match):
    with pytest.raises(MsdsError, match=match):
        call()


def test_cpu_without_the_interpreter_is_refused_for_backend_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(MsdsError, match=r"t: is on cpu; the Triton kernels run on CUDA tensors"):
        coalesce_tensor(torch.randn(4, 4), [], backend="triton")


def test_the_streamed_transition_operators_on_the_kernels():
    """What a transition runs per group (msds.train.transition): coalesce of a depth group and the
    fused de-coalesce + interpolate of one small tensor, for weights and both moments, on the kernels
    equal the PyTorch path (de-coalesce + interpolate bit for bit); `auto` keeps CPU tensors on PyTorch."""
    from msds.config import model_config
    from msds.model.files import model_tensors
    from msds.model.transformer import Transformer
    from msds.multilevel.operators import (KINDS, coalesce, coalesce_groups, decoalesce_interpolate,
                                           decoalesced_names, plan_level)

    cfg = model_config("gpt-tiny", num_layers=4, vocab_size=64)
    level = plan_level(cfg, hidden=2, heads=2, ffn=2, layers=2)
    large = {n: t.abs() for n, t in model_tensors(Transformer(cfg)).items()}
    group = next(g for g in coalesce_groups(large, level) if g[0].endswith("mlp.fc1.weight"))
    assert group == ["layers.0.mlp.fc1.weight", "layers.1.mlp.fc1.weight"]       # adjacent pair -> small layer 0
    name = "layers.0.mlp.fc1.weight"
    for kind in KINDS:
        members = {n: large[n] for n in group}
        small = coalesce(members, level, kind=kind, backend="triton")
        reference = coalesce(members, level, kind=kind, backend="torch")
        torch.testing.assert_close(small, reference, rtol=1e-6, atol=1e-6)
        saved = {n: large[n] for n in decoalesced_names(name, level)}
        got = decoalesce_interpolate({name: reference[name]}, saved, level, 0.75, kind=kind, backend="triton")
        want = decoalesce_interpolate({name: reference[name]}, saved, level, 0.75, kind=kind, backend="torch")
        assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
    tensor, axes = large[name], [(0, Grouping(cfg.ffn_size, 2)), (1, Grouping(cfg.hidden_size, 2))]
    assert not backends.use_kernels(tensor, axes, "auto") and backends.use_kernels(tensor, axes, "triton")
