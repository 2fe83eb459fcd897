"""The files msds ships next to its code: the DeepSpeed JSON templates, the recipes and the
measured results.

In the repository they are the top-level directories `ds_configs/` and `recipes/` (recipes/bench/:
one bench per question of BENCHMARKS.md; recipes/paper/: the paper-scale runs; recipes/test/: the
test suite's; demo.yaml at the top) and `benchmarks/results/` (the JSON tables of BENCHMARKS.md,
which `msds plan` reads to place a run among the measured budgets); setup.py installs
them as the packages `msds.ds_configs`, `msds.recipes` and `msds.results` (package data), so they are found through
`importlib.resources` the same way in an editable install (`pip install -e .`, which maps those
packages back onto the checkout's directories) and in a wheel (`pip install .`, which copies them
into site-packages/msds/). Nothing else in msds locates them.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

DS_CONFIGS_PACKAGE = "msds.ds_configs"
RECIPES_PACKAGE = "msds.recipes"
RESULTS_PACKAGE = "msds.results"
RECIPE_SUFFIX = ".yaml"


def _directory(package: str) -> Path:
    # Installed packages live on the file system (msds is never imported from a zip), so the
    # resource root is a real directory that file paths can name.
    return Path(str(resources.files(package)))


def ds_configs_dir() -> Path:
    return _directory(DS_CONFIGS_PACKAGE)


def ds_template(stage: int) -> Path:
    """The packaged DeepSpeed template of a ZeRO stage (ds_configs/zero<stage>.json)."""
    return ds_configs_dir() / f"zero{stage}.json"


def ds_template_names() -> list[str]:
    return sorted(p.name for p in ds_configs_dir().iterdir() if p.suffix == ".json")


def results_dir() -> Path:
    """The committed benchmark tables (benchmarks/results/*.json)."""
    return _directory(RESULTS_PACKAGE)


def recipes_dir() -> Path:
    return _directory(RECIPES_PACKAGE)


def _recipe_files() -> dict[str, Path]:
    """Every packaged recipe by name (its file name without `.yaml`), in recipes/ and its folders;
    the names are unique across folders (tests/test_package.py checks), so a name needs no folder."""
    return {p.stem: p for p in sorted(recipes_dir().rglob(f"*{RECIPE_SUFFIX}"))}


def recipe_names() -> list[str]:
    """Names of the packaged recipes, without `.yaml` or folder."""
    return sorted(_recipe_files())


def recipe(name: str) -> Path | None:
    """The packaged recipe `name` (`prototype-gpt` or `prototype-gpt.yaml`, whichever folder of
    recipes/ holds it), or None when there is none of that name. Only a bare name matches: anything
    with a directory part is a path, not a recipe name."""
    if not name or "/" in name or "\\" in name:
        return None
    stem = name[: -len(RECIPE_SUFFIX)] if name.endswith(RECIPE_SUFFIX) else name
    return _recipe_files().get(stem)
