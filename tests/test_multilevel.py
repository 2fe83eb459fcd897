"""Multi-level operators (msds.multilevel): groupings, coalesce / de-coalesce / interpolate of whole
models through the role table, Adam-moment mapping, shard-local use and bad input."""
import json

import pytest
import torch

from msds.model.files import load_into
from msds.config import ConfigError, model_config
from msds.errors import MsdsError
from msds.model.roles import expected_shapes
from msds.model.transformer import Transformer
from msds.multilevel import Grouping, LevelMap, coalesce, decoalesce, interpolate, level_from_scheme, plan_level
from msds.multilevel.tensor_ops import coalesce_tensor, decoalesce_tensor

# Shapes with g = 2 and g = 3 possible (with 2 shards too); the GPT one has head_dim 6 and ffn != 4h.
SHAPES = {
    2: [dict(arch="bert", hidden_size=48, num_heads=4, ffn_size=96, num_layers=4, vocab_size=97, nsp_head=True),
        dict(arch="gpt", hidden_size=32, num_heads=4, ffn_size=120, num_layers=4, vocab_size=101)],
    3: [dict(arch="bert", hidden_size=36, num_heads=6, ffn_size=72, num_layers=6, vocab_size=89),
        dict(arch="gpt", hidden_size=36, num_heads=6, ffn_size=90, num_layers=6, vocab_size=89)],
}
CASES = [(g, i, layout, shards) for g in (2, 3) for i in range(2)
         for layout in ("adjacent", "strided") for shards in (1, 2)]
CASE_IDS = [f"g{g}-{SHAPES[g][i]['arch']}-{layout}-s{s}" for g, i, layout, s in CASES]


def make_cfg(g, i):
    arch = SHAPES[g][i]["arch"]
    extra = dict(norm_eps=1e-12, activation="gelu") if arch == "bert" else dict(norm_eps=1e-5, activation="gelu_tanh")
    return model_config(**SHAPES[g][i], **extra, max_positions=32, hidden_dropout=0.0, attention_dropout=0.0)


def random_tensors(cfg, seed=0, positive=False):
    """Random tensors of every parameter; norms around 1 so that LayerNorm scales are realistic."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        t = torch.randn(shape, generator=gen)
        if positive:
            t = t.abs()
        elif "norm.weight" in name:
            t = 1.0 + 0.2 * t
        else:
            t = 0.2 * t
        out[name] = t
    return out


def level_for(g, i, layout, shards, depth=True):
    cfg = make_cfg(g, i)
    s = {"heads": shards, "ffn": shards, "layers": shards}
    return plan_level(cfg, hidden=g, heads=g, ffn=g, layers=g if depth else 1, layout=layout,
                      depth_layout=layout, shards=s)


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def model_from(cfg, tensors):
    model = Transformer(cfg)
    load_into(model, tensors)
    return model.eval()


def token_batch(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=gen)
    if cfg.arch == "gpt":
        return ids, {}
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, -3:] = 0
    types = torch.zeros(2, 11, dtype=torch.long)
    types[:, 5:] = 1
    return ids, {"token_type_ids": types, "attention_mask": mask}


# --------------------------------------------------------------------------------------------
# Groupings
# --------------------------------------------------------------------------------------------

def test_grouping_layouts_follow_the_definitions():
    assert Grouping(8, 2, "adjacent").members().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert Grouping(8, 2, "strided").members().tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert Grouping(9, 3, "strided").members().tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    # two shards: each small shard (2 small units) comes from one large shard (4 units)
    sharded = Grouping(8, 2, "strided", shards=2)
    assert sharded.members().tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sharded.shard_local(2, 1) == Grouping(4, 2, "strided")
    assert Grouping(8, 2, "strided", shards=4).shard_local(2, 1).members().tolist() == [[0, 1], [2, 3]]
    for grouping in (sharded, Grouping(12, 3, "adjacent", shards=2), Grouping.from_groups([[2, 0], [1, 3]], 4, "x")):
        members, owner = grouping.members(), grouping.owner()
        assert sorted(members.flatten().tolist()) == list(range(grouping.units))
        assert (owner[members] == torch.arange(grouping.small_units).unsqueeze(1)).all()
        assert Grouping.from_dict(json.loads(json.dumps(grouping.to_dict()))) == grouping


def test_authors_head_pairs_cross_tensor_parallel_shards():
    with pytest.raises(ConfigError, match="cross the 2 shards"):
        Grouping(12, 2, "strided").shard_local(2, 0)


def test_tensor_ops_match_dense_mapping_matrices():
    """W_small = A_out W S_in^T and W_large = C_out W_small A_in (METHOD 1.2) on a blocked axis."""
    out_group, in_group = Grouping(6, 3, "strided"), Grouping(4, 2, "adjacent")

    def dense(grouping, block, kind):
        m = torch.zeros(grouping.small_units * block, grouping.units * block, dtype=torch.float64)
        for i, group in enumerate(grouping.members().tolist()):
            for j in group:
                m[i * block:(i + 1) * block, j * block:(j + 1) * block] = torch.eye(block)
        return m / grouping.factor if kind == "A" else m

    w = torch.randn(6 * 5, 4 * 2, dtype=torch.float64)                      # out blocks 5, in blocks 2
    small = coalesce_tensor(w, [(0, out_group), (1, in_group)], scale=in_group.factor)
    torch.testing.assert_close(small, dense(out_group, 5, "A") @ w @ dense(in_group, 2, "S").T)
    large = decoalesce_tensor(small, [(0, out_group), (1, in_group)], scale=in_group.factor)
    torch.testing.assert_close(large, dense(out_group, 5, "S").T @ small @ dense(in_group, 2, "A"))


# --------------------------------------------------------------------------------------------
# Whole-model properties
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("g,i,layout,shards", CASES, ids=CASE_IDS)
def test_coalesce_after_decoalesce_is_identity(g, i, layout, shards):
    level = level_for(g, i, layout, shards)
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        small = random_tensors(level.small, seed=1, positive=kind == "exp_avg_sq")
        large = decoalesce(small, level, kind)
        assert {n: tuple(t.shape) for n, t in large.items()} == expected_shapes(level.large)
        again = coalesce(large, level, kind)
        assert {n: tuple(t.shape) for n, t in again.items()} == expected_shapes(level.small)
        assert max_diff(again, small) <= 1e-6, kind


@pytest.mark.parametrize("g,i,layout,shards", CASES, ids=CASE_IDS)
def test_width_decoalescing_keeps_the_logits(g, i, layout, shards):
    level = level_for(g, i, layout, shards, depth=False)
    small = random_tensors(level.small, seed=2)
    large = decoalesce(small, level)
    small_model, large_model = model_from(level.small, small), model_from(level.large, large)
    ids, extra = token_batch(level.large)
    with torch.no_grad():
        expected = small_model(ids, **extra)
        assert rel(large_model(ids, **extra), expected) < 1e-5
        if level.large.nsp_head:
            h_small = small_model.hidden_states(ids, **extra)
            h_large = large_model.hidden_states(ids, **extra)
            assert rel(large_model.head.next_sentence_logits(h_large),
                       small_model.head.next_sentence_logits(h_small)) < 1e-5


def test_width_decoalescing_with_separate_factors_keeps_the_logits():
    """Hidden halved, heads kept, FFN by 4: attention width then differs from hidden (head_dim kept)."""
    level = plan_level(make_cfg(2, 1), hidden=2, heads=1, ffn=4, layout="strided")
    assert (level.small.hidden_size, level.small.num_heads, level.small.head_dim, level.small.ffn_size) == (16, 4, 8, 30)
    small = random_tensors(level.small, seed=3)
    ids, _ = token_batch(level.large)
    with torch.no_grad():
        assert rel(model_from(level.large, decoalesce(small, level))(ids), model_from(level.small, small)(ids)) < 1e-5


def test_width_moment_mapping_reproduces_the_gradients():
    """docs/method.md §4.2: for width, de-coalesced first/second moments of the small model's gradient
    are the large model's gradient (squared), and coalescing maps them back."""
    level = plan_level(make_cfg(2, 1), hidden=2, heads=2, ffn=2, layout="strided")
    small = random_tensors(level.small, seed=4)
    grads = {}
    for which, cfg, tensors in (("small", level.small, small), ("large", level.large, decoalesce(small, level))):
        model = model_from(cfg, tensors)
        ids, _ = token_batch(cfg)
        model(ids, labels=ids).backward()
        grads[which] = {n: p.grad for n, p in model.named_parameters()}
    for kind, power in (("exp_avg", 1), ("exp_avg_sq", 2)):
        small_moment = {n: t ** power for n, t in grads["small"].items()}
        large_moment = {n: t ** power for n, t in grads["large"].items()}
        mapped_up = decoalesce(small_moment, level, kind)
        mapped_down = coalesce(large_moment, level, kind)
        for name in large_moment:
            assert rel(mapped_up[name], large_moment[name]) < 1e-5, (kind, name)
        for name in small_moment:
            assert rel(mapped_down[name], small_moment[name]) < 1e-5, (kind, name)


@pytest.mark.parametrize("g,layout", [(2, "adjacent"), (2, "strided"), (3, "strided")])
def test_depth_round_trip_is_exact_and_coalescing_averages_layers(g, layout):
    level = plan_level(make_cfg(g, 1), layers=g, depth_layout=layout)
    small = random_tensors(level.small, seed=5)
    large = decoalesce(small, level)
    members = level.groupings["layers"].members().tolist()
    for small_layer, group in enumerate(members):
        for layer in group:
            assert torch.equal(large[f"layers.{layer}.mlp.fc1.weight"], small[f"layers.{small_layer}.mlp.fc1.weight"])
    again = coalesce(large, level)
    assert all(torch.equal(again[n], small[n]) for n in small)
    # coalescing a model whose layers differ averages each group
    other = random_tensors(level.large, seed=6)
    merged = coalesce(other, level)
    for small_layer, group in enumerate(members):
        mean = torch.stack([other[f"layers.{layer}.attn.qkv.weight"] for layer in group]).mean(0)
        torch.testing.assert_close(merged[f"layers.{small_layer}.attn.qkv.weight"], mean, rtol=0, atol=1e-7)
    assert torch.equal(merged["embeddings.word.weight"], other["embeddings.word.weight"])


def test_interpolate_ends_are_exact():
    level = level_for(2, 0, "strided", 1)
    saved = random_tensors(level.large, seed=7)
    new = decoalesce(coalesce(saved, level), level)
    at_zero, at_one = interpolate(new, saved, 0.0), interpolate(new, saved, 1)
    assert all(torch.equal(at_zero[n], saved[n]) for n in saved)
    assert all(torch.equal(at_one[n], new[n]) for n in saved)
    half = interpolate(new, saved, 0.5)
    assert max_diff(half, {n: (saved[n] + new[n]) / 2 for n in saved}) < 1e-6
    assert not torch.equal(half["layers.0.attn.qkv.weight"], saved["layers.0.attn.qkv.weight"])


def test_inputs_are_not_modified():
    level = level_for(2, 1, "strided", 1)
    large = random_tensors(level.large, seed=8)
    before = {n: t.clone() for n, t in large.items()}
    small = coalesce(large, level)
    decoalesce(small, level)
    interpolate(large, before, 0.3)
    assert all(torch.equal(large[n], before[n]) for n in large)


def test_authors_scheme_equals_strided_factors():
    """The authors' L6-H6 scheme (head i with i + H/2, layer i with i + L/2) groups hidden and FFN in
    blocks following the heads: for these pairs that is the per-channel strided grouping."""
    cfg = model_config(arch="bert", hidden_size=48, num_heads=6, ffn_size=96, num_layers=6, vocab_size=50,
                       max_positions=16)
    pairs = [[i, i + 3] for i in range(3)]
    authors = level_from_scheme(cfg, {"width_scheme": pairs, "depth_scheme": pairs,
                                      "reserved_heads": [], "reserved_layers": []})
    ours = level_from_scheme(cfg, {"hidden": 2, "heads": 2, "ffn": 2, "layers": 2, "layout": "strided",
                                   "depth_layout": "strided"})
    assert authors.small == ours.small
    large = random_tensors(cfg, seed=9)
    assert max_diff(coalesce(large, authors), coalesce(large, ours)) == 0.0


def test_level_map_survives_json_and_drives_decoalescing():
    level = level_for(3, 0, "adjacent", 2)
    again = LevelMap.from_dict(json.loads(json.dumps(level.to_dict())))
    assert again == level
    small = random_tensors(level.small, seed=10)
    assert max_diff(decoalesce(small, again), decoalesce(small, level)) == 0.0


def test_shard_local_pieces_match_the_full_mapping():
    """A tensor-parallel rank coalesces / de-coalesces its own slices with level.shard_local(tp, rank)
    and gets the slices of the full result."""
    tp = 2
    level = level_for(2, 0, "strided", tp)
    split_dim = {"attn.qkv.weight": 0, "attn.qkv.bias": 0, "attn.proj.weight": 1, "mlp.fc1.weight": 0,
                 "mlp.fc1.bias": 0, "mlp.fc2.weight": 1, "embeddings.word.weight": 0, "head.bias": 0}

    def piece(tensors, rank):
        out = {}
        for name, t in tensors.items():
            dim = next((d for suffix, d in split_dim.items() if name.endswith(suffix)), None)
            out[name] = t if dim is None else t.chunk(tp, dim)[rank]
        return out

    large = random_tensors(level.large, seed=11)
    small = coalesce(large, level)
    for rank in range(tp):
        local = level.shard_local(tp, rank)
        assert max_diff(coalesce(piece(large, rank), local), piece(small, rank)) == 0.0
        assert max_diff(decoalesce(piece(small, rank), local), piece(decoalesce(small, level), rank)) == 0.0
    # pipeline stages: layers 0-1 with the embeddings, layers 2-3 with the head, under global names
    for stage, (first, last) in enumerate(((0, 1), (2, 3))):
        keep = [n for n in large if (n.startswith("embeddings") if stage == 0 else n.startswith("head"))
                or any(n.startswith(f"layers.{i}.") for i in (first, last))]
        stage_small = coalesce({n: large[n] for n in keep}, level)
        assert max_diff(stage_small, {n: small[n] for n in stage_small}) == 0.0
        assert any(n.startswith(f"layers.{stage}.") for n in stage_small)


# --------------------------------------------------------------------------------------------
# Bad input: one clear error each
# --------------------------------------------------------------------------------------------

def test_bad_factors_name_the_field():
    cfg = make_cfg(2, 0)                               # hidden 48, 4 heads, ffn 96, 4 layers
    with pytest.raises(ConfigError, match=r"multilevel\.levels\[1\]\.hidden: factor 5 does not divide hidden_size 48"):
        plan_level(cfg, hidden=5, path="multilevel.levels[1]")
    with pytest.raises(ConfigError, match=r"multilevel\.levels\[1\]\.heads: factor 3 does not divide num_heads 4"):
        plan_level(cfg, heads=3, path="multilevel.levels[1]")
    with pytest.raises(ConfigError, match=r"\.layers: factor 4 does not divide num_layers 4 in each of 2 shards"):
        plan_level(cfg, layers=4, shards={"layers": 2})
    with pytest.raises(ConfigError, match=r"\.depth_layout: 'diagonal'"):
        plan_level(cfg, layers=2, depth_layout="diagonal")
    with pytest.raises(ConfigError, match=r"\.ffn: expected a positive integer"):
        plan_level(cfg, ffn=0)


@pytest.mark.parametrize("scheme,message", [
    ({"width_scheme": [[0, 2], [1, 2]]}, r"scheme\.width_scheme: index 2 appears in more than one group"),
    ({"width_scheme": [[0, 1], [2, 2]]}, r"index 2 appears in more than one group"),
    ({"width_scheme": [[0, 1]]}, r"scheme\.width_scheme: index 2 is in no group"),
    ({"width_scheme": [[0, 1], [2, 3, 4]]}, r"different sizes"),
    ({"depth_scheme": [[0, 1], [2, 7]]}, r"scheme\.depth_scheme: index 7 is outside 0\.\.3"),
    ({"width_scheme": [[0, 1], [2, 3]], "reserved_heads": [1]}, r"scheme\.reserved_heads: .* not supported"),
    ({"heads": 2, "widht": 2}, r"scheme\.widht: unknown key"),
    ({"heads": 3}, r"scheme\.heads: factor 3 does not divide num_heads 4"),
])
def test_bad_schemes_name_the_field(scheme, message):
    with pytest.raises(ConfigError, match=message):
        level_from_scheme(make_cfg(2, 0), scheme)


def test_mismatched_tensors_are_refused():
    level = level_for(2, 0, "strided", 1)
    small = random_tensors(level.small)
    with pytest.raises(MsdsError, match="shapes disagree"):
        coalesce(small, plan_level(level.large, hidden=2, layers=1))      # small model given as large
    with pytest.raises(MsdsError, match="not a parameter of the level's large model"):
        coalesce({"layers.9.attn.qkv.weight": torch.zeros(1)}, level)
    large = random_tensors(level.large)
    del large["layers.1.mlp.fc1.bias"]
    with pytest.raises(MsdsError, match=r"layers\.1\.mlp\.fc1\.bias: missing, but layers \[1, 3\] merge"):
        coalesce(large, level)
    saved = random_tensors(level.large)
    with pytest.raises(MsdsError, match=r"shape .* disagrees with the saved"):
        interpolate({**saved, "head.bias": torch.zeros(3)}, saved, 0.5)
    with pytest.raises(MsdsError, match="missing from the de-coalesced"):
        interpolate({}, saved, 0.5)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), True])
def test_alpha_outside_unit_interval_is_refused(alpha):
    with pytest.raises(ConfigError, match=r"alpha: .* is outside \[0, 1\]"):
        interpolate({}, {}, alpha)
