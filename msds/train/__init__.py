"""Training: DeepSpeed engines, the V-cycle schedule, level transitions, checkpoints and metrics.

Data flows one way: config -> data + model -> engine -> loop -> checkpoints/metrics. The loop
(`loop.py`) asks `transition.py`, the one place that changes levels, for the next level's engine.
"""
