"""A bench's plots: validation loss against cumulative FLOPs and against wall-clock, every variant
and every seed drawn."""
from __future__ import annotations

from pathlib import Path

from msds.bench.saving import BenchResults

STYLES = ["-", "--", ":", "-."]      # one line style per seed
AXES = (("flops", "cumulative training FLOPs", "loss_vs_flops.png"),
        ("train_seconds", "training wall-clock (s)", "loss_vs_time.png"))


def _draw(ax, results: BenchResults, key: str) -> None:
    """Every run's curve, one color per variant and one style per seed, and each seed's target."""
    colors = {}
    for i, seed in enumerate(results.per_seed.values()):
        style = STYLES[i % len(STYLES)]
        for name, r in seed.variants.items():
            kwargs = {"color": colors[name]} if name in colors else {}
            line, = ax.plot([getattr(e, key) for e in r.evals], [e.val_loss for e in r.evals], linestyle=style,
                            marker=".", markersize=3, label=name if name not in colors else None, **kwargs)
            colors.setdefault(name, line.get_color())
        ax.axhline(seed.target_val_loss, color="black", linewidth=0.8, linestyle=style)


def _loss_range(results: BenchResults) -> tuple[float, float]:
    """From below the lowest final loss to above the highest loss after the first evaluation."""
    runs = [r for s in results.per_seed.values() for r in s.variants.values()]
    finals = [r.final_val_loss for r in runs]
    tops = [r.evals[1].val_loss for r in runs if len(r.evals) > 1]
    return min(finals) - 0.2, max(tops or finals) + 0.1


def plot(results: BenchResults, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, filename in AXES:
        fig, ax = plt.subplots(figsize=(8, 5))
        _draw(ax, results, key)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.set_title("validation loss; one line style per seed, black: the reference's final loss")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax.set_ylim(*_loss_range(results))
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=120)
        plt.close(fig)
        paths.append(out_dir / filename)
    return paths
