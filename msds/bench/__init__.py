"""`msds bench` (cli.py documents the command): variants side by side over seeds and the saving at
equal quality.

    variants.py   a bench config -> each variant's run config (the baseline sweep, seeds, fairness)
    sweep.py      the sweep's grid (schedules x learning rates x warmups); is the reference interior
    training.py   the runs still to train, trained one after the other or --jobs at a time
    runs.py       what a finished run holds: evaluations, transitions, the load it was timed under
    saving.py     the cost to reach the reference's final loss, per seed, then mean / worst
    at_target.py  each variant's model where it first reaches the target (eval.at: target)
    multiplier.py the reference at larger budgets; each variant's compute multiplier k
    report.py     the headline and results.md's tables
    plots.py      loss against FLOPs and against wall-clock
    run.py        run_bench: all of the above, writing results.json, results.md and the plots
    doc_tables.py `msds report`: BENCHMARKS.md's and README.md's tables from benchmarks/results/*.json
"""
