"""The run plan: a RunConfig checked and turned, once, into everything a run derives from it
(see msds/plan/build.py). `msds plan` prints it without training."""
from msds.plan.build import Layout, RunPlan, build_plan, check_environment
from msds.plan.schedule import Phase

__all__ = ["Layout", "Phase", "RunPlan", "build_plan", "check_environment"]
