"""Speed of the multi-level operators on a BERT-Large-shaped model (24 layers, hidden 1024, 16 heads,
FFN 4096, vocab 30522), width and depth by 2 (strided), on CPU:

- structured: msds.multilevel (index / reshape reductions and expansions, linear in size);
- dense: the mapping-matrix formulation of the authors' tool, W' = F_out W F_in^T with dense F per
  axis, and a dense layer matrix R for depth (width first, then depth, as their mapper does).

Both compute the same thing (checked). Interpolation: torch.lerp in msds, the authors' expression
(1 - alpha) * saved + alpha * new (three tensor operations) in the dense row. The dense matrices are
built before the clock starts. Run:

    nice .venv/bin/python benchmarks/map_speed.py [--repeats 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import torch

from msds.config import model_config
from msds.model.roles import expected_shapes, parameter_roles
from msds.multilevel import coalesce, decoalesce, interpolate, plan_level


class DenseMapper:
    """The dense formulation: one (small x large) matrix per grouped axis, applied by matmul."""

    def __init__(self, level):
        self.level = level
        self.roles = parameter_roles(level.large)
        self.small_roles = parameter_roles(level.small)
        self.matrices = {}
        shapes = expected_shapes(level.large)
        for name, role in self.roles.items():
            for dim, axis in enumerate(role.axes):
                if axis.role in level.groupings:
                    self._sum_matrix(axis.role, shapes[name][dim] // level.groupings[axis.role].units)
        depth = level.groupings["layers"]
        self.depth_avg = self._sum_matrix("layers", 1) / depth.factor     # R: small x large layers
        self.depth_copy = self._sum_matrix("layers", 1).T.contiguous()   # its copy transpose

    def _sum_matrix(self, role: str, block: int) -> torch.Tensor:
        """S (m*block x n*block): S[i, j] = 1 where large channel j belongs to small channel i."""
        key = (role, block)
        if key not in self.matrices:
            grouping = self.level.groupings[role]
            s = torch.zeros(grouping.small_units * block, grouping.units * block)
            eye = torch.eye(block)
            for i, group in enumerate(grouping.members().tolist()):
                for j in group:
                    s[i * block:(i + 1) * block, j * block:(j + 1) * block] = eye
            self.matrices[key] = s
        return self.matrices[key]

    def _width(self, t, role, coalescing: bool) -> torch.Tensor:
        for dim, axis in enumerate(role.axes):
            grouping = self.level.groupings.get(axis.role) if axis.role else None
            if grouping is None:
                continue
            units = grouping.units if coalescing else grouping.small_units
            s = self._sum_matrix(axis.role, t.shape[dim] // units)
            g = grouping.factor
            if coalescing:   # out: average (S/g), in: sum (S)
                f = s / g if axis.side == "out" else s
            else:            # out: copy (S^T), in: copy / g (S^T / g)
                f = s.T if axis.side == "out" else s.T / g
            t = f @ t if dim == 0 else t @ f.T
        return t

    def _map(self, tensors, coalescing: bool):
        roles = self.roles if coalescing else self.small_roles
        depth_matrix = self.depth_avg if coalescing else self.depth_copy
        target_layers = self.level.small.num_layers if coalescing else self.level.large.num_layers
        out, stacks = {}, {}
        for name, t in tensors.items():
            role = roles[name]
            mapped = self._width(t, role, coalescing)
            if role.layer is None:
                out[name] = mapped
            else:
                stacks.setdefault(name[len(f"layers.{role.layer}."):], {})[role.layer] = mapped
        for suffix, layers in stacks.items():
            stacked = torch.stack([layers[i] for i in sorted(layers)])
            merged = (depth_matrix @ stacked.flatten(1)).view(target_layers, *stacked.shape[1:])
            for i in range(target_layers):
                out[f"layers.{i}.{suffix}"] = merged[i]
        return out

    def coalesce(self, tensors):
        return self._map(tensors, True)

    def decoalesce(self, tensors):
        return self._map(tensors, False)


def authors_interpolate(decoalesced, saved, alpha):
    """The authors' mix, (1 - alpha) * saved + alpha * de-coalesced, as three tensor operations."""
    return {name: (1 - alpha) * saved[name] + alpha * decoalesced[name] for name in saved}


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each operation (best is kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both; 1 by default because on a shared, oversubscribed "
                             "machine spinning OpenMP threads make multi-threaded timings erratic")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = model_config("bert-large")
    level = plan_level(cfg, hidden=2, heads=2, ffn=2, layers=2, layout="strided", depth_layout="adjacent")
    gen = torch.Generator().manual_seed(0)
    large = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in expected_shapes(cfg).items()}
    params = sum(t.numel() for t in large.values())
    dense = DenseMapper(level)

    # The machine may be shared: the two implementations alternate, run after run, so that both see
    # the same load, and the best run of each operation is kept.
    impls = {"structured": (lambda t: coalesce(t, level), lambda t: decoalesce(t, level), interpolate),
             "dense": (dense.coalesce, dense.decoalesce, authors_interpolate)}
    results = {label: dict(coalesce=float("inf"), decoalesce=float("inf"), interpolate=float("inf"))
               for label in impls}
    for _ in range(args.repeats):
        for label, (impl_coalesce, impl_decoalesce, impl_interpolate) in impls.items():
            r = results[label]
            t_c, r["small"] = timed(lambda: impl_coalesce(large))
            t_d, r["back"] = timed(lambda: impl_decoalesce(r["small"]))
            t_i, _ = timed(lambda: impl_interpolate(r["back"], large, 0.5))
            for op, seconds in (("coalesce", t_c), ("decoalesce", t_d), ("interpolate", t_i)):
                r[op] = min(r[op], seconds)

    agree = max(max((results["structured"][k][n] - results["dense"][k][n]).abs().max().item()
                    for n in results["structured"][k]) for k in ("small", "back"))
    print(f"BERT-Large shape: {params / 1e6:.1f}M parameters, width and depth by 2 (strided width, "
          f"adjacent layers), {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"structured vs dense results: max abs difference {agree:.2e}")
    print("| implementation | coalesce (s) | de-coalesce (s) | interpolate (s) | total (s) |")
    print("|---|---|---|---|---|")
    totals, mapping = {}, {}
    for label, r in results.items():
        mapping[label] = r["coalesce"] + r["decoalesce"]
        totals[label] = mapping[label] + r["interpolate"]
        print(f"| {label} | {r['coalesce']:.3f} | {r['decoalesce']:.3f} | {r['interpolate']:.3f} | {totals[label]:.3f} |")
    print(f"speedup (dense / structured): total {totals['dense'] / totals['structured']:.1f}x, "
          f"coalesce + de-coalesce {mapping['dense'] / mapping['structured']:.1f}x")


if __name__ == "__main__":
    main()
