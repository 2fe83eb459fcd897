"""Training: DeepSpeed engines, level transitions, the loop, checkpoints and metrics.

Data flows one way: config -> plan -> data + model -> engine -> loop -> checkpoints/metrics. The
loop (`loop.py`) reads the run plan (msds.plan) and calls `transition.py`, the one place that
changes levels, at each phase boundary.
"""
