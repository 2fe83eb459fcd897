"""Patches of, and reads of, the private APIs of msds's pinned libraries: the place for them.

msds is pinned to these versions (setup.py pins the same):

    deepspeed      0.19.8   msds.compat.deepspeed_0_19
    megatron-core  0.16.1   msds.compat.megatron_core_0_16

The rest of msds calls the small named functions of those two modules instead of touching private
attributes itself. Each function's docstring says what it does, why msds needs it and which test in
tests/test_compat.py shows whether it is still needed: moving a pin means running that file against
the new version, deleting what it shows to be unnecessary and renaming the module.

`check_versions()` (called by msds.distributed.init_distributed) raises `VersionMismatch` when an
installed version differs from its pin: the patches reach into internals that can change meaning
between releases without raising anything, so running on other versions is refused rather than
warned about. Set MSDS_ALLOW_UNPINNED=1 to get a warning instead, e.g. to
run tests/test_compat.py against a candidate version.
"""
from __future__ import annotations

import importlib.metadata
import os
import warnings

from msds.errors import MsdsError

PINNED = {"deepspeed": "0.19.8", "megatron-core": "0.16.1"}
ALLOW_UNPINNED = "MSDS_ALLOW_UNPINNED"


class VersionMismatch(MsdsError):
    """An installed library's version is not the one msds.compat's patches were written for."""


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution` (its pip name), None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_mismatches() -> list[str]:
    """One line per pinned library whose installed version differs from its pin."""
    lines = []
    for name, pinned in PINNED.items():
        found = installed_version(name)
        if found != pinned:
            state = f"{found} is installed" if found else "is not installed"
            lines.append(f"{name} {state}, msds needs {pinned}")
    return lines


def check_versions() -> None:
    """Raise VersionMismatch naming every library off its pin (a warning instead when the
    environment variable MSDS_ALLOW_UNPINNED is set to a non-empty value other than 0)."""
    mismatches = version_mismatches()
    if not mismatches:
        return
    message = (f"{'; '.join(mismatches)}. msds.compat patches private APIs of exactly these versions; "
               f"install them (pip install deepspeed=={PINNED['deepspeed']} "
               f"megatron-core=={PINNED['megatron-core']}), or set {ALLOW_UNPINNED}=1 to run anyway "
               f"and check the patches with tests/test_compat.py")
    if os.environ.get(ALLOW_UNPINNED, "0") not in ("", "0"):
        warnings.warn(message, stacklevel=2)
        return
    raise VersionMismatch(message)
