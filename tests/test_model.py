"""The msds transformer against Hugging Face transformers, the role table, HF interop and bad input."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from msds.model.files import load_into, load_model, model_tensors, save_model
from msds.cli import main as msds_main
from msds.config import ConfigError, model_config
from msds.errors import MsdsError
from msds.model.hf import bert_from_hf, config_to_hf, gpt_from_hf, read_hf, write_hf
from msds.model.roles import expected_shapes, parameter_roles
from msds.model.transformer import Transformer

transformers.logging.set_verbosity_error()

SHAPES = {  # two shapes per architecture; the second has head_dim != 16 and odd sizes
    "bert": [dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=300, ffn_size=128),
             dict(hidden_size=96, num_layers=3, num_heads=3, vocab_size=211, ffn_size=200, max_positions=40)],
    "gpt": [dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=300, ffn_size=128),
            dict(hidden_size=96, num_layers=3, num_heads=3, vocab_size=211, ffn_size=200, max_positions=40)],
}
CASES = [(arch, i) for arch in SHAPES for i in range(2)]
DEFAULTS = {"bert": dict(arch="bert", norm_eps=1e-12, activation="gelu"),
            "gpt": dict(arch="gpt", norm_eps=1e-5, activation="gelu_tanh")}


def make_cfg(arch, i, **extra):
    return model_config(**DEFAULTS[arch], **SHAPES[arch][i], hidden_dropout=0.0, attention_dropout=0.0, **extra)


def hf_model(cfg):
    hf_cfg = config_to_hf(cfg)
    if cfg.arch == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**hf_cfg))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_cfg))


def batch(cfg, seed=0, size=(3, 17)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, size, generator=g)
    if cfg.arch == "gpt":
        return ids, {}
    mask = torch.ones(size, dtype=torch.long)
    mask[0, -5:] = 0                              # one padded sequence
    types = torch.zeros(size, dtype=torch.long)
    types[:, size[1] // 2:] = 1
    return ids, {"token_type_ids": types, "attention_mask": mask}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def compare_forward_backward(msds_model, hf, cfg):
    """Logits in eval mode; loss and every parameter gradient in training mode (dropout 0)."""
    ids, extra = batch(cfg)
    msds_model.eval(), hf.eval()
    with torch.no_grad():
        ours, theirs = msds_model(ids, **extra), hf(ids, **extra).logits
    keep = extra.get("attention_mask", torch.ones_like(ids)).bool()
    assert rel(ours[keep], theirs[keep]) < 1e-5

    msds_model.train(), hf.train()
    if cfg.arch == "bert":
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) > 0.3] = -100
        labels[~keep] = -100
        hf_loss = hf(ids, labels=labels, **extra).loss
        our_loss = msds_model(ids, labels=labels, **extra)
    else:  # HF shifts GPT labels inside; msds takes next-token labels from the data pipeline
        hf_loss = hf(ids, labels=ids).loss
        our_loss = msds_model(ids, labels=torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1))
    assert abs(our_loss.item() - hf_loss.item()) < 1e-5 * hf_loss.item()
    msds_model.zero_grad(), hf.zero_grad()
    our_loss.backward(), hf_loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    mapped, _ = (bert_from_hf if cfg.arch == "bert" else gpt_from_hf)(hf_grads, cfg)
    ours_grads = {n: p.grad for n, p in msds_model.named_parameters()}
    assert set(mapped) == set(ours_grads)
    for name, grad in ours_grads.items():
        assert rel(grad, mapped[name]) < 1e-5, name


@pytest.mark.parametrize("arch,i", CASES)
def test_msds_to_hf_parity(arch, i, tmp_path):
    cfg = make_cfg(arch, i)
    torch.manual_seed(i)
    model = Transformer(cfg)
    save_model(tmp_path / "ckpt", cfg, model_tensors(model))
    assert msds_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    cls = transformers.BertForMaskedLM if arch == "bert" else transformers.GPT2LMHeadModel
    hf = cls.from_pretrained(tmp_path / "hf")
    compare_forward_backward(model, hf, cfg)


@pytest.mark.parametrize("arch,i", CASES)
def test_hf_to_msds_parity(arch, i, tmp_path):
    cfg = make_cfg(arch, i)
    torch.manual_seed(100 + i)
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path / "hf")
    assert msds_main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    loaded_cfg, tensors, _ = load_model(tmp_path / "ckpt")
    assert loaded_cfg == cfg
    model = Transformer(loaded_cfg)
    load_into(model, tensors)
    compare_forward_backward(model, hf, cfg)


@pytest.mark.parametrize("arch", ["bert", "gpt"])
def test_head_runs_on_the_labelled_positions(arch):
    """BERT's head sees only the masked positions' hidden states (the parity tests above show the
    loss and gradients are HF's dense ones); GPT's sees every position, all of which it predicts."""
    cfg = make_cfg(arch, 0)
    model = Transformer(cfg)
    ids, extra = batch(cfg)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.15] = -100
    seen = []
    model.head.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    model(ids, labels=labels, **extra).backward()
    model(ids, **extra)   # no labels: the logits of every position
    labelled = int((labels != -100).sum())
    expected = (labelled, cfg.hidden_size) if arch == "bert" else (*ids.shape, cfg.hidden_size)
    assert seen == [expected, (*ids.shape, cfg.hidden_size)]
    assert 0 < labelled < ids.numel()


def test_gathered_positions_give_the_masked_loss_and_gradients():
    """BERT with `masked_positions` (data.max_predictions_per_seq): the head sees [batch, k] rows,
    a fixed shape, and the loss and gradients are the boolean selection's up to summation order."""
    cfg = make_cfg("bert", 0)
    model = Transformer(cfg)
    ids, extra = batch(cfg)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.25] = -100
    labels[:, 0] = -100                                       # position 0 ([CLS]) has no label
    k = int((labels != -100).sum(dim=1).max()) + 2
    order = torch.argsort((labels == -100).int(), dim=1, stable=True)[:, :k]
    positions = torch.where(labels.gather(1, order) != -100, order, 0)
    seen = []
    model.head.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    losses, grads = [], []
    for kwargs in ({}, {"masked_positions": positions}):
        model.zero_grad()
        loss = model(ids, labels=labels, **extra, **kwargs)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert seen[1] == (ids.shape[0], k, cfg.hidden_size)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for ours, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_minilm_import_export_keeps_hidden_states(tmp_path):
    from msds.model.parity import minilm_roundtrip

    errors = minilm_roundtrip(tmp_path)
    assert errors["msds_vs_hf"] < 1e-5
    assert errors["exported_vs_original"] < 1e-5


@pytest.mark.parametrize("arch,nsp", [("bert", False), ("bert", True), ("gpt", False)])
def test_role_table_covers_every_parameter(arch, nsp):
    cfg = model_config(f"{arch}-tiny", nsp_head=nsp)
    params = {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}
    assert params == expected_shapes(cfg)
    roles = parameter_roles(cfg)
    assert all(len(role.axes) == len(params[name]) for name, role in roles.items())
    layered = [n for n, r in roles.items() if r.layer is not None]
    assert len(layered) == 12 * cfg.num_layers


def test_bert_nsp_head_exports_as_pretraining_model(tmp_path):
    cfg = make_cfg("bert", 0, nsp_head=True)
    model = Transformer(cfg)
    write_hf(tmp_path / "hf", cfg, model_tensors(model))
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ids, extra = batch(cfg)
    with torch.no_grad():
        ours = model.head.next_sentence_logits(model.eval().hidden_states(ids, **extra))
        theirs = hf(ids, **extra).seq_relationship_logits
    assert rel(ours, theirs) < 1e-5


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------

def test_config_that_does_not_divide_names_the_field():
    with pytest.raises(ConfigError, match=r"^model\.num_heads: hidden_size 100 is not divisible"):
        model_config("gpt-tiny", hidden_size=100, num_heads=3)


def test_unknown_architecture_and_key_are_named():
    with pytest.raises(ConfigError, match=r"^model\.arch: 'llama' is not one of 'bert', 'gpt'"):
        model_config(arch="llama")
    with pytest.raises(ConfigError, match=r"^model\.hidden: unknown key"):
        model_config("gpt-tiny", hidden=3)
    with pytest.raises(ConfigError, match=r"^model\.preset: unknown size 'gpt-huge'"):
        model_config("gpt-huge")


def test_hf_directory_with_unknown_architecture(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                             "model_type": "llama"}))
    assert msds_main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported architecture" in err[0] and "LlamaForCausalLM" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["missing", "misshaped"])
def test_checkpoint_with_bad_tensor_is_named(tmp_path, capsys, damage):
    cfg = make_cfg("gpt", 0)
    save_model(tmp_path / "ckpt", cfg, model_tensors(Transformer(cfg)))
    weights = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(str(weights))
    if damage == "missing":
        del tensors["layers.1.mlp.fc2.weight"]
        expected = "tensor layers.1.mlp.fc2.weight is missing"
    else:
        tensors["layers.0.attn.qkv.weight"] = tensors["layers.0.attn.qkv.weight"][:-1]
        expected = r"tensor layers.0.attn.qkv.weight has shape \(191, 64\), expected \(192, 64\)"
    save_file(tensors, str(weights))
    with pytest.raises(MsdsError, match=expected):
        load_model(tmp_path / "ckpt")
    assert msds_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_hf_checkpoint_missing_a_tensor(tmp_path):
    cfg = make_cfg("bert", 0)
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["bert.encoder.layer.1.attention.self.key.bias"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(MsdsError, match="tensor bert.encoder.layer.1.attention.self.key.bias is missing"):
        read_hf(tmp_path / "hf")


def test_truncated_checkpoint_is_reported(tmp_path):
    cfg = make_cfg("gpt", 0)
    save_model(tmp_path / "ckpt", cfg, model_tensors(Transformer(cfg)))
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(MsdsError, match="truncated or corrupt"):
        load_model(tmp_path / "ckpt")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blockwise_loss_is_the_logits_loss(dtype, monkeypatch):
    """`linear_cross_entropy`, a block of rows at a time, gives the loss and gradients of the logits
    path (product, bias, padding rows at -inf, megatron's cross entropy) over several blocks, with
    ignored labels and padding rows; without gradients, the same loss. Half precisions against fp32:
    under fp16 a loss scale's gradient neither underflows nor overflows."""
    import torch.nn.functional as F
    from msds.distributed import init_distributed
    from msds.model import linear_loss
    from msds.model.transformer import token_loss

    init_distributed()
    monkeypatch.setattr(linear_loss, "BLOCK_ELEMENTS", 40 * 100)   # 40 rows of 100: eight blocks
    g = torch.Generator().manual_seed(0)
    features = torch.randn(3, 100, 16, generator=g)
    weight, bias = torch.randn(100, 16, generator=g) * 0.3, torch.randn(100, generator=g) * 0.1
    labels = torch.randint(0, 90, (3, 100), generator=g)
    labels[:, ::7] = -100
    scale = 4096.0 if dtype == torch.float16 else 3.0

    def loss_and_grads(fn, cast):
        inputs = [t.to(cast).requires_grad_() for t in (features, weight, bias)]
        loss = fn(*inputs)
        return loss.detach().float(), [grad.float() for grad in torch.autograd.grad(loss * scale, inputs)]

    def logits_loss(f, w, b):
        logits = (F.linear(f, w) + b).float().masked_fill(torch.arange(100) >= 90, float("-inf"))
        return token_loss(logits, labels)

    blockwise = lambda f, w, b: linear_loss.linear_cross_entropy(f, w, b, labels, 90)   # noqa: E731
    loss, grads = loss_and_grads(blockwise, dtype)
    expected_loss, expected = loss_and_grads(logits_loss, torch.float32)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert abs(loss - expected_loss) < tolerance * expected_loss
    for grad, want in zip(grads, expected):
        assert rel(grad, want) < tolerance
    assert grads[1][90:].abs().max() == 0 and grads[2][90:].abs().max() == 0   # padding rows
    with torch.no_grad():
        assert linear_loss.linear_cross_entropy(features.to(dtype), weight.to(dtype), bias.to(dtype), labels,
                                                90).float() == loss


def test_block_rows_by_device():
    """A CPU block holds 2**21 logits (256 rows of BERT/GPT-prototype's 8192-token vocabulary), an
    accelerator's 2**26 (1,335 rows of GPT-2's 50,257); a vocabulary wider than a block still gets a row."""
    from msds.model.linear_loss import block_rows

    assert block_rows(torch.device("cpu"), 8192) == 256
    assert block_rows(torch.device("cuda", 0), 50257) == 1335
    assert block_rows(torch.device("cpu"), 2**22) == 1
