"""The files msds ships next to its code: the DeepSpeed JSON templates and the recipes.

In the repository they are the top-level directories `ds_configs/` and `recipes/`; setup.py installs
them as the packages `msds.ds_configs` and `msds.recipes` (package data), so they are found through
`importlib.resources` the same way in an editable install (`pip install -e .`, which maps those
packages back onto the checkout's directories) and in a wheel (`pip install .`, which copies them
into site-packages/msds/). Nothing else in msds locates them.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

DS_CONFIGS_PACKAGE = "msds.ds_configs"
RECIPES_PACKAGE = "msds.recipes"
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


def recipes_dir() -> Path:
    return _directory(RECIPES_PACKAGE)


def recipe_names() -> list[str]:
    """Names of the packaged recipes, without `.yaml`."""
    return sorted(p.stem for p in recipes_dir().iterdir() if p.suffix == RECIPE_SUFFIX)


def recipe(name: str) -> Path | None:
    """The packaged recipe `name` (`demo` or `demo.yaml`), or None when there is none of that name.
    Only a bare name matches: anything with a directory part is a path, not a recipe name."""
    if not name or "/" in name or "\\" in name:
        return None
    stem = name[: -len(RECIPE_SUFFIX)] if name.endswith(RECIPE_SUFFIX) else name
    path = recipes_dir() / f"{stem}{RECIPE_SUFFIX}"
    return path if path.is_file() else None
