"""`msds bench`: the baseline and its V-cycle variants side by side, and the saving at equal quality.

    msds bench --config prototype-gpt --out bench_out/prototype-gpt [--seeds 1 2 3] [key=value ...]

A bench config has a `base` run config (model, data, optimizer, training, logging, ...) shared by
every run, `variants`: name -> overrides of `base` (one must be named `baseline`), and optionally:
- `seeds: [1, 2, 3]` (or `--seeds`): every variant runs once per seed, with `training.seed` and
  `data.seed` set to it (initial weights, dropout, data order and validation batches all change).
  Run directories are <out>/seed<s>/<variant>; without seeds, <out>/<variant> with the config's seeds.
- `baseline_lr_sweep: [0.5, 1, 2, 4]` and `baseline_warmup_sweep: [24, 48]`: the baseline is also
  trained at each factor of its peak learning rate and each warmup length (variants named
  `baseline-lr2x`, `baseline-lr2x-wu48`, ...; the recipe's own setting stays `baseline`). The member
  with the lowest mean final validation loss over the seeds is the *reference*: a saving against an
  untuned baseline is not a saving.
- `baseline_schedule_sweep: [{schedule: cosine, min_lr_ratio: 0.1}, {schedule: linear, min_lr_ratio: 0},
  {schedule: wsd, min_lr_ratio: 0, decay_fraction: 0.2}]`: the sweep's grid also runs over these
  schedules (optimizer.schedule and its fields; names gain e.g. `-linear0`, `-wsd0-d0.2` where the
  schedule is not the baseline's own); an entry's own `lr_factors: [...]` and `warmups: [...]` replace
  the two sweeps above for that schedule. With this list the baseline's own schedule is swept only
  where an entry names it (a rate or warmup sweep that no entry takes is refused). The report says
  whether the reference is an interior optimum (along the learning rate and the warmup, where more
  than one value was swept, both neighbours were run and ended worse) and warns loudly when it sits
  at a grid edge (msds/bench/sweep.py).
- `reference_budgets: [1.5, 2]`: the reference is also trained at these multiples of its steps, each
  with its own full schedule, and each other variant gets its compute multiplier k: the FLOPs the
  baseline needs to end at the variant's final loss, in multiples of its own (msds/bench/multiplier.py).
  Factors below 1 ([0.5, 0.75, 1.5, 2]) give a number to a variant that ends above the 1x run too.
- `eval: {tasks: [...], ...}` (msds/eval/bench.py, docs/evaluation.md): the reference and every variant
  outside the sweep are evaluated downstream in every seed; results.md shows the scores beside the
  savings and says which variants are at equal quality; the headline then names the largest saving
  among those, and any variant that saves more but falls short (equal quality: on every task the
  mean paired difference to the reference, per seed, is at least minus one standard error). With `at: target` a
  variant's quality is that of its model where it first reaches the target, the point its saving
  is counted at: its run is trained again to that evaluation's step (<run>/at-target), not its end.

Every variant of a seed trains on the same data order with the same tokens per step and the same
evaluation points. For each seed and variant the report gives the final validation loss, the FLOPs
and wall-clock at which its validation loss first reaches the reference's final validation loss of
that seed (linearly interpolated between evaluations; only the full-size model's evaluations count,
not a smaller level's), the saving = 1 - that cost / the reference's
cost, and the time spent in transitions; then, over the seeds, the mean and the worst saving (a
variant that misses the target in any seed has no mean, and says in which seeds it missed).
Wall-clock is training time: steps plus transitions, evaluations excluded (the same for every
variant); it is only comparable between runs made under the same load, such as N runs that
`--jobs N` trains at the same time (each in its own process with 1/N of the threads, its output in
<run>/bench.log; `make demo` uses `--jobs 2`). Each run's summary.json records the load it trained
under (cores, threads, runs at once, the machine's mean 1-minute load average), and the report marks
a wall-clock saving not timed under its reference's load (`same_load`; a run without a record beside
one with a record counts as not), as when a reused reference trained alone and the variant beside
others. Stopping such a bench (SIGTERM, Ctrl-C) stops its runs with a checkpoint. Finished runs of
the same config are reused; a run directory of another config is refused with the field that
differs, since starting it again would resume its checkpoints. Outputs: results.json, results.md,
loss_vs_flops.png, loss_vs_time.png (every seed drawn).
"""
from __future__ import annotations

import argparse

from msds.eval.bench import EVAL_POINTS


def _run(args) -> int:
    from msds.bench.run import run_bench

    run_bench(args.config, args.out, args.overrides, args.only, args.seeds, args.jobs, args.eval_at)
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="bench config, or a packaged recipe's name (recipes/bench/: prototype-gpt, ...)")
    parser.add_argument("--out", required=True, help="output directory (one run directory per variant and seed)")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                        help="run every variant once per seed (overrides the config's `seeds`)")
    parser.add_argument("--only", nargs="+", metavar="VARIANT", help="train and report only these variants and "
                        "the baseline sweep (which always runs; names such as vcycle+random-ltd as they are); put "
                        "key=value overrides before --only")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="train N runs at a time, each in its own process with 1/N of the threads "
                             "(one-process benches only; default: %(default)s)")
    parser.add_argument("--eval-at", choices=EVAL_POINTS, help="where the config's eval: section scores each "
                        "variant, replacing its `eval.at`: final (its final model) or target (its model where it "
                        "first reaches the reference's final loss)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the shared `base` config")
    parser.set_defaults(run=_run)
