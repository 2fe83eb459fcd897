"""Multi-level operators (docs/method.md §2-4): groupings, coalesce, de-coalesce, interpolate, Adam-moment
mapping, and the offline `msds map` tool (cli.py)."""
from msds.multilevel.grouping import Grouping
from msds.multilevel.operators import (LevelMap, coalesce, decoalesce, interpolate, level_from_scheme,
                                       plan_level)

__all__ = ["Grouping", "LevelMap", "coalesce", "decoalesce", "interpolate", "level_from_scheme", "plan_level"]
