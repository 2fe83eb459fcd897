"""The installed package, not the checkout: `pip install .` (non-editable, no dependencies, nothing
downloaded) into a fresh target directory, then, from a directory outside the checkout and with only
that copy importable, `msds data prepare` on a small corpus and a tiny `msds train` V-cycle that
names its recipe by name. This proves the DeepSpeed templates (ds_configs/) and the recipes
(recipes/) ship inside the package (setup.py, msds/resources.py) and that nothing reads the checkout.

Run with `pytest -s tests/test_package.py` to watch its progress lines.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Never copied into the build: the checkout's environment, outputs and stale build trees.
SKIP_AT_ROOT = {".git", ".venv", "build", "dist", "data", "runs", "bench_out", ".pytest_cache"}
SKIP_ANYWHERE = ("__pycache__", ".egg-info")


def say(message: str) -> None:
    print(f"[installed package] {message}", flush=True)


def _ignore(directory: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if n.endswith(SKIP_ANYWHERE)}
    if Path(directory) == REPO:
        skipped |= SKIP_AT_ROOT & set(names)
    return skipped


def _run(args: list, cwd: Path, env: dict, timeout: int) -> str:
    start = time.monotonic()
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{output[-4000:]}"
    say(f"  done in {time.monotonic() - start:.1f} s")
    return proc.stdout


def _corpus(path: Path) -> int:
    """A JSON-lines corpus of real text, one document per paragraph of the repository's Markdown and
    Python sources: about a thousand documents, so the 2% valid and test splits are never empty."""
    paragraphs = []
    for pattern in ("*.md", "docs/*.md", "msds/**/*.py", "tests/**/*.py"):
        for source in sorted(REPO.glob(pattern)):
            for block in source.read_text(encoding="utf-8").split("\n\n"):
                if len(block.strip()) >= 40:
                    paragraphs.append(block.strip())
    assert len(paragraphs) >= 500, f"only {len(paragraphs)} paragraphs for the corpus"
    with open(path, "w") as f:
        for text in paragraphs:
            f.write(json.dumps({"text": text}) + "\n")
    return len(paragraphs)


def test_installed_package_trains_outside_the_checkout(tmp_path):
    assert not tmp_path.resolve().is_relative_to(REPO), "the work directory must be outside the checkout"
    source, site, work = tmp_path / "source", tmp_path / "site", tmp_path / "work"
    work.mkdir()

    say(f"copying the checkout's sources to {source}")
    shutil.copytree(REPO, source, ignore=_ignore)

    say(f"pip install --no-deps --target {site} (non-editable, offline)")
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
          "--target", site, source], cwd=work, env=dict(os.environ), timeout=300)
    for folder, suffix in (("ds_configs", ".json"), ("recipes", ".yaml")):
        shipped = sorted((REPO / folder).rglob(f"*{suffix}"))    # recipes/bench/, paper/, test/ too
        assert shipped, f"no {folder}/**/*{suffix} in the checkout"
        for path in shipped:
            installed = site / "msds" / path.relative_to(REPO)
            assert installed.is_file(), f"{path.relative_to(REPO)} is not in the installed package ({installed})"
            assert installed.read_bytes() == path.read_bytes()
    say(f"  the package holds {len(list((site / 'msds' / 'ds_configs').glob('*.json')))} DeepSpeed templates "
        f"and {len(list((site / 'msds' / 'recipes').rglob('*.yaml')))} recipes")

    # Only the installed copy is importable: the checkout is neither on PYTHONPATH nor the cwd.
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    # A plain one-process run: drop the launcher variables the in-process tests leave behind
    # (msds.distributed sets RANK/WORLD_SIZE for one process), or DeepSpeed looks for a launcher.
    for name in ("PYTHONHOME", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)

    say("msds data prepare --jsonl (installed console script, a small corpus made from the package's text)")
    corpus_file = work / "corpus.jsonl"
    say(f"  {_corpus(corpus_file)} documents")
    data = work / "data"
    _run([site / "bin" / "msds", "data", "prepare", "--tokenizer", "bpe-1024", "--jsonl", corpus_file,
          "--out", data], cwd=work, env=env, timeout=300)
    assert (data / "manifest.json").is_file()

    say("msds train --config test-vcycle-gpt (the packaged recipe, by name; 3-level V-cycle, 30 steps)")
    run_dir = work / "run"
    launcher = ("import sys, msds, msds.resources as r; "
                "print('msds:', msds.__file__); print('template:', r.ds_template(1)); "
                "print('recipe:', r.recipe('test-vcycle-gpt'), flush=True); "
                "from msds.cli import main; sys.exit(main(sys.argv[1:]))")
    out = _run([sys.executable, "-c", launcher, "train", "--config", "test-vcycle-gpt", f"data.path={data}",
                f"run_dir={run_dir}", "logging.tensorboard=false"], cwd=work, env=env, timeout=600)
    where = dict(line.split(": ", 1) for line in out.splitlines()
                 if line.startswith(("msds: ", "template: ", "recipe: ")))
    say(f"  msds imported from {where['msds']}")
    assert Path(where["msds"]) == site / "msds" / "__init__.py", where
    assert Path(where["template"]) == site / "msds" / "ds_configs" / "zero1.json", where
    assert Path(where["recipe"]) == site / "msds" / "recipes" / "test" / "test-vcycle-gpt.yaml", where

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    transitions = [r for r in records if r["event"] == "transition"]
    assert steps and steps[-1]["step"] == 30, records[-3:]
    assert len(transitions) == 4, transitions
    say(f"  trained 30 steps through {len(transitions)} transitions, final loss {steps[-1]['loss']:.3f}")


def test_recipe_names_are_unique_across_folders():
    """A recipe is found by its bare name in whichever folder of recipes/ holds it
    (msds/resources.py), so no two folders may hold the same name."""
    from msds import resources

    stems = [p.stem for p in (REPO / "recipes").rglob("*.yaml")]
    assert len(stems) == len(set(stems)), sorted(s for s in stems if stems.count(s) > 1)
    assert set(resources.recipe_names()) == set(stems)
    assert resources.recipe("prototype-gpt").resolve() == REPO / "recipes" / "bench" / "prototype-gpt.yaml"
    paper = REPO / "recipes" / "paper" / "bert-large-vcycle3.yaml"
    assert resources.recipe("bert-large-vcycle3.yaml").resolve() == paper
    assert resources.recipe("bench/prototype-gpt") is None       # a path, not a name
