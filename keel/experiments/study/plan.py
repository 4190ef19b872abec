"""The ``keel study --dry-run`` estimate: every group's jobs as planned before anything trains
(:func:`planned_jobs`), one row per group (:func:`plan_rows`: runs, tokens, GPU- and CPU-hours), the
totals and the markdown table."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from keel.config import config_from_dict, override_text
from keel.errors import KeelError
from keel.experiments import stress as ST
from keel.experiments.grid import GridJob
from keel.experiments.study.lrs import group_jobs, group_records, stepped_lrs
from keel.experiments.study.records import restored_record, run_record
from keel.experiments.study.spec import Group, Study, lr_ladder
from keel.experiments.table import markdown_table
from keel.model import count_parameters, flops_per_token, loop_count
from keel.train.parallelize import checkpointed_blocks


def hours_words(h: float) -> str:
    """GPU-hours for the plan: one decimal, or two significant digits below 1 (a cpu-scale group
    read "0.0")."""
    return f"{h:,.1f}" if h >= 1 else f"{h:.2g}"


# One run's torch.compile cost (train.compile = true: the training and evaluation graphs of its blocks), in CPU
# seconds, measured at the cpu study's reference cell (Keel, 256 sub-layers x width 64, torch 2.13, 1 thread,
# inductor's C++ compiled in-process) by `benchmarks/cell_speed.py --cold` (benchmarks/README.md): "cold" with
# inductor's caches empty (a grid's first run of a shape), "warm" reading them (its later runs of that shape).
# A scheme whose blocks differ (AttnRes: one graph per source count) compiles more graphs than this.
COMPILE_CPU_S = {"cold": 25.0, "warm": 2.0}  # measured 24.6 and 1.6 (pre_ln: 20.6 and 1.2)


def compile_words(rows: list[dict]) -> list[str]:
    """The ``--dry-run`` lines on compile time: [] when no planned run compiles (``compiled`` of
    :func:`plan_rows`), else what :data:`COMPILE_CPU_S` adds per run and in all."""
    n = sum(r.get("compiled", 0) for r in rows)
    if not n:
        return []
    cold, warm = COMPILE_CPU_S["cold"], COMPILE_CPU_S["warm"]
    return ["", f"train.compile is on for {n} of these runs: each compiles its blocks when it starts, about {cold:.0f} "
                f"s of CPU on a cold cache (a grid's first run of a shape) and {warm:.0f} s warm (later runs of that "
                f"shape read inductor's on-disk cache), measured at the cpu study's 256-sub-layer, width-64 cell "
                f"(benchmarks/cell_speed.py; more for schemes whose blocks differ); at most {n * cold / 3600:.2g} "
                "CPU-hours in all, not in the hours above."]


# One CPU core's training time per token, t = CPU_S_PER_TOKEN + flops_per_token / CPU_FLOPS (seconds): fitted to the
# median wall time of the cpu claims study's finished 1,024,000-token runs (width 64, one torch thread per run, two
# runs on the two cores of its machine: docs/results/study-cpu/report.md), 10.1 min at 64 and 26.1 min at 256
# sub-layers (12.8M and 50.7M FLOPs per token). The fixed part is what does not grow with the model (data, the
# optimiser's Python, validation, checkpoints); a looped run costs as its effective depth (the FLOPs of the
# unrolled model).
CPU_S_PER_TOKEN = 2.74e-4
CPU_FLOPS = 4.04e10
# Activation checkpointing recomputes a block's forward in the backward. On a GPU that is a forward's FLOPs, a third
# of the training FLOPs (2 of 6 N + 12 n_layers d T: PaLM App. B counts rematerialisation so). On this CPU at width
# 64, where a forward is most of a step's time, it added 0.7 of a step: a step of the 1,028-sub-layer looped Keel
# (8 x 128 tokens, one thread) took 3.8 s without checkpointing and 6.5 s with every block checkpointed, measured
# back to back twice (keel/configs/studies/looped.toml).
RECOMPUTE_FLOPS = 1 / 3
CPU_RECOMPUTE = 0.7


def recompute_share(cfg) -> float:
    """The share of a run's applied blocks (over its steps) whose forward activation checkpointing recomputes,
    for a :class:`keel.config.Config` ``cfg``: 0 without it; the checkpointed share of the blocks of weights
    (:func:`keel.train.parallelize.checkpointed_blocks`: 1 for ``block``, about 1/k for ``every_k``); for a looped
    model with ``train.activation_checkpoint_min_loops`` = n > 0, only on the steps whose drawn count
    (:func:`keel.model.loop_count`, a pure function of seed and step) is at least n, weighted by the blocks each
    step applies (P + count C + Q)."""
    tc, m = cfg.train, cfg.model
    share = len(checkpointed_blocks(m.n_layers, tc.activation_checkpointing, tc.activation_checkpoint_k)) / m.n_layers
    if not share or not (m.loop_core and tc.activation_checkpoint_min_loops):
        return share
    counts = [loop_count(m, tc.seed, step) or m.loop_repeats for step in range(tc.steps)]
    blocks = [m.n_layers + (c - 1) * m.loop_core for c in counts]
    return share * sum(b for b, c in zip(blocks, counts) if c >= tc.activation_checkpoint_min_loops) / sum(blocks)


def cpu_hours(tokens: float, flops: float, recomputed: float = 0.0) -> float:
    """Estimated CPU-hours (one core per run) of training ``tokens`` tokens at ``flops`` training FLOPs in all,
    of which the share ``recomputed`` (:func:`recompute_share`, FLOP-weighted) is checkpointed:
    ``(tokens * CPU_S_PER_TOKEN + flops / CPU_FLOPS + CPU_RECOMPUTE * recomputed * flops / CPU_FLOPS) / 3600``
    (:data:`CPU_S_PER_TOKEN`, :data:`CPU_FLOPS`, :data:`CPU_RECOMPUTE`)."""
    return (tokens * CPU_S_PER_TOKEN + flops / CPU_FLOPS * (1 + CPU_RECOMPUTE * recomputed)) / 3600


def planned_jobs(study: Study, data_dir: str, out: Path, restored: dict[tuple[str, str], dict] | None = None
                 ) -> list[tuple[Group, list[GridJob], list[GridJob]]]:
    """(group, reference jobs, jobs) of every group as planned before anything trains: an
    ``lr_from`` group at the optimum of its source's runs in ``restored`` (:func:`load_restored`)
    when they give one, else as if the optimum were the middle of its source's LR grid; LRs
    widened where the restored runs put an optimum on an edge. Raises KeelError on a bad config."""
    restored = restored or {}
    planned, runs = [], []
    for g in study.groups:
        def read(refs, jobs, now, g=g):  # nothing trains: every pass only reads
            olds = [restored_record(g, j, restored[(g.name, j.name)]) if (g.name, j.name) in restored else None
                    for j in jobs]
            return [o if o is not None else run_record(g, j, Path(), None) for j, o in zip(jobs, olds)]

        with _naming_group(g):
            got = group_records(study, g, runs, data_dir, out, read)
            if got is None:  # the source's optimum is unknown: plan at the middle of its grid
                grid = lr_ladder(study.groups, g)
                lr_for = {(s, L): lrs for s, lrs in stepped_lrs(study, g, {s: grid[len(grid) // 2] for s in g.schemes}
                                                                 ).items() for L in g.sublayers}
                got = (*group_jobs(study, g, data_dir, out, lr_for), [])
        runs += [r for r in got[2] if r.status == "done"]
        planned.append((g, got[0], got[1]))
    return planned


@contextlib.contextmanager
def _naming_group(g: Group):
    """Re-raise a KeelError of building group ``g``'s run configs as ``study group 'g' (its set): ...`` when
    ``g`` has a ``set`` of its own: the study's keys (base, scale, ``--set``) were checked before
    (:func:`keel.experiments.study.run.execute`), so its own keys are what the message is about."""
    try:
        yield
    except KeelError as e:
        if not g.sets:
            raise
        raise KeelError(f"study group {g.name!r} (its set {', '.join(override_text(x) for x in g.sets)}): {e}") from None


def plan_rows(study: Study, data_dir: str, out: Path, mfu: float, peak_tflops: float,
              restored: dict[tuple[str, str], dict] | None = None) -> list[dict]:
    """One row per group: runs (+ references), optimizer steps and tokens per run (the planned
    budget; a ramp run stops earlier when it diverges), tokens per non-embedding parameter per
    depth (``tokens_per_param_by_scheme``: ``{sub-layers: {scheme: ratio}}``; ``tokens_per_param``: ``{sub-layers:
    ratio}`` of the first scheme at each depth), total tokens and estimated GPU-hours at ``mfu`` of a
    ``peak_tflops`` (dense bf16 TFLOP/s) GPU, the runs that compile (``compiled``: ``train.compile``);
    ``restored`` (:func:`load_restored`) plans as
    :func:`planned_jobs` does and counts the runs it holds (``restored``) and the GPU-hours of the
    others (``gpu_hours_left``). An ``lr_from`` group is planned as if the optimum were the middle
    of its source's LR grid when ``restored`` does not give it."""
    rows, restored = [], restored or {}
    for g, refs, jobs in planned_jobs(study, data_dir, out, restored):
        cfgs = [config_from_dict(j.config) for j in refs + jobs]
        _check_named_depths(g, cfgs)
        per_run = [c.train.steps * c.train.batch_size * c.train.seq_len * c.train.grad_accum for c in cfgs]
        by_scheme = _tokens_per_param(per_run[len(refs):], cfgs[len(refs):])
        flops = [t * flops_per_token(c.model, c.train.seq_len) for t, c in zip(per_run, cfgs)]
        shares = [recompute_share(c) for c in cfgs]
        redone = sum(f * x for f, x in zip(flops, shares))  # the FLOPs of the forwards checkpointing recomputes, x 3
        hw = [f * (1 + RECOMPUTE_FLOPS * x) for f, x in zip(flops, shares)]  # hardware FLOPs (PaLM App. B)
        held = _held_runs(g, refs, jobs, restored)
        hours = 1 / (mfu * peak_tflops * 1e12) / 3600
        rows.append({"group": g.name, "kind": g.kind, "runs": len(jobs), "references": len(refs),
                     "steps": sorted({c.train.steps for c in cfgs[len(refs):]}),
                     "tokens_per_param": {L: next(iter(by.values())) for L, by in by_scheme.items()},
                     "tokens_per_param_by_scheme": by_scheme,
                     **_plan_axes(g, cfgs[len(refs):]),
                     "tokens_per_run": sorted(set(per_run)), "tokens": sum(per_run), "flops": sum(flops),
                     "gpu_hours": sum(hw) * hours,
                     "cpu_hours": cpu_hours(sum(per_run), sum(flops), redone / sum(flops) if sum(flops) else 0.0),
                     "restored": sum(held[len(refs):]),
                     "gpu_hours_left": sum(f for f, h in zip(hw, held) if not h) * hours,
                     "compiled": sum(1 for c in cfgs if c.train.compile)})  # runs that torch.compile (plan.compile_words)
    return rows


def _check_named_depths(g: Group, cfgs: list) -> None:
    """Raise KeelError (one line) when the runs of group ``g``, named and tabled by its ``sublayers``, apply
    other depths: a group without ``loop`` sets ``model.n_layers = L/2`` blocks of weights, so loop keys set
    with R > 1 (``--set model.loop_repeats=3``) make each run 2 (P + R C + Q) sub-layers deep, not L."""
    applied = sorted({c.model.n_sublayers for c in cfgs})
    if g.sublayers and applied != sorted(set(g.sublayers)):
        c = next(c for c in cfgs if c.model.n_sublayers not in g.sublayers)
        m = c.model
        raise KeelError(f"group {g.name}: its runs of {2 * m.n_layers} sub-layers apply {m.n_sublayers} with the loop "
                        f"keys set (2 (P + R C + Q) = 2 ({m.loop_prelude} + {m.loop_repeats} x {m.loop_core} + "
                        f"{m.n_layers - m.loop_prelude - m.loop_core})); a grid over effective depths is a study "
                        "group's loop = [P, C, Q] (docs/looped.md)")


def _held_runs(g: Group, refs: list[GridJob], jobs: list[GridJob], restored: dict[tuple[str, str], dict]
               ) -> list[bool]:
    """Per reference job and job of group ``g`` (in that order): whether it would not train, its record in
    ``restored`` (a reference: no job that trains needs it, as :func:`keel.experiments.study.run._train_and_read`
    trains them)."""
    held = [(g.name, j.name) in restored and restored_record(g, j, restored[(g.name, j.name)]) is not None
            for j in jobs]
    needed = ST.references_of([j for j, h in zip(jobs, held) if not h])  # as _train_and_read trains them
    return [r.name not in needed for r in refs] + held


def _tokens_per_param(per_run: list[int], cfgs: list) -> dict[int, dict[str, float]]:
    """``{sub-layers: {scheme: tokens per non-embedding parameter}}`` of a group's runs (``per_run``: their tokens,
    ``cfgs``: their configs), by depth, the schemes in the order of their first run (a scheme's first run at a
    depth gives its ratio: its seeds and LRs share it)."""
    per_param: dict[int, dict[str, float]] = {}
    for t, c in zip(per_run, cfgs):
        m = replace(c.model, vocab_size=256) if c.model.vocab_size == "auto" else c.model  # as flops_per_token
        per_param.setdefault(c.model.n_sublayers, {}).setdefault(c.model.residual,
                                                                t / count_parameters(m, non_embedding=True))
    return dict(sorted(per_param.items()))


def _tokens_per_param_words(by_scheme: dict[int, dict[str, float]]) -> str:
    """The plan's cell of tokens per non-embedding parameter (:func:`_tokens_per_param`): per depth one value
    where every scheme's rounds to it ("68: 0.161"), else each value with its schemes ("16: keel 2.39,
    pre_ln/post_ln 2.4"); depths apart by "; ", "–" for none."""
    cells = []
    for L, by in by_scheme.items():
        schemes_of: dict[str, list[str]] = {}
        for scheme, x in by.items():
            schemes_of.setdefault(f"{x:.3g}", []).append(scheme)
        words = (", ".join(f"{'/'.join(names)} {w}" for w, names in schemes_of.items()) if len(schemes_of) > 1
                 else next(iter(schemes_of)))
        cells.append(f"{L}: {words}")
    return "; ".join(cells) or "–"


def _plan_axes(g: Group, cfgs: list) -> dict:
    """What a plan row says group ``g`` varies (``cfgs``: its runs' configs): ``schemes``, ``sublayers``,
    ``seeds``, ``lrs`` (an LR grid's) and ``lr_plan`` (words); a group that does not list them (a sweep's)
    gives its runs' values."""
    seen = {k: list(dict.fromkeys(get(c) for c in cfgs)) for k, get in (  # a sweep's: its runs' values
        ("residual", lambda c: c.model.residual), ("n_sublayers", lambda c: c.model.n_sublayers),
        ("seed", lambda c: c.train.seed), ("lr", lambda c: c.train.lr))}
    return {"schemes": g.schemes or seen["residual"], "sublayers": g.sublayers or seen["n_sublayers"],
            "seeds": g.seeds or seen["seed"], "lrs": list(g.lrs) if g.kind_class.lr_grid and not g.lr_from else [],
            "lr_plan": g.kind_class.lr_words(g) or ", ".join(f"{x:g}" for x in seen["lr"])}


def plan_total(rows: list[dict]) -> dict:
    """The sums of :func:`plan_rows`' ``runs``, ``references``, ``tokens``,
    ``flops``, ``gpu_hours``, ``cpu_hours``, ``restored`` (runs a ``--restore`` report holds) and ``gpu_hours_left``."""
    keys = ("runs", "references", "tokens", "flops", "gpu_hours", "cpu_hours", "restored", "gpu_hours_left")
    return {k: sum(r[k] for r in rows) for k in keys}


def plan_markdown(study: Study, rows: list[dict], mfu: float, peak_tflops: float, restore: str | None = None) -> str:
    """The ``--dry-run`` table; with ``restore`` (the ``--restore`` report), how many of each group's
    runs it holds and the GPU-hours left to train."""
    cells = [[r["group"], f"{r['runs']}" + (f" + {r['references']} ref." if r["references"] else "")
              + (f" ({r['restored']} restored)" if restore is not None else ""), ", ".join(r["schemes"]),
              ", ".join(map(str, r["sublayers"])), ", ".join(map(str, r["seeds"])), r["lr_plan"],
              ", ".join(map(str, r.get("steps", []))), ", ".join(f"{t:,.0f}" for t in r["tokens_per_run"]),
              _tokens_per_param_words(r.get("tokens_per_param_by_scheme", {})),
              f"{r['tokens']:.3g}", hours_words(r["gpu_hours"]), hours_words(r["cpu_hours"])] for r in rows]
    given = ([f"Every run also with --set {', '.join(study.user_sets)} (applied after the scale's keys: where it "
              "differs from them" + (" or from the scale's note above" if study.note else "")
              + ", the runs follow the --set).", ""] if study.user_sets else [])
    lines = [f"Study {study.name}, scale {study.scale}: {study.note}".strip(), ""] + given + markdown_table(
        ["group", "runs", "schemes", "sub-layers", "seeds", "LRs", "steps", "tokens per run",
         "tokens per non-embedding parameter, by depth", "total tokens", "est. GPU-hours", "est. CPU-hours"], cells)
    tot = plan_total(rows)
    lines += ["", f"Total: {tot['runs'] + tot['references']} runs, "
                  f"{tot['tokens']:.3g} tokens, about {hours_words(tot['gpu_hours'])} GPU-hours "
                  f"(training FLOPs 6N + 12 n_layers d T per token, PaLM App. B, with the forwards that "
                  f"activation checkpointing recomputes, at {mfu:.0%} MFU of "
                  f"{peak_tflops:g} TFLOP/s dense bf16{', an H100 SXM' if peak_tflops == 989 else ''}; "
                  f"evaluation not counted), or about {hours_words(tot['cpu_hours'])} CPU-hours on one core per run "
                  "(fitted to the cpu claims study's runs at width 64: keel.experiments.study.plan.cpu_hours)."]
    if restore is not None:
        lines += ["", f"{tot['restored']} of these runs are restored from {restore} and would not train: "
                      f"about {hours_words(tot['gpu_hours_left'])} GPU-hours are left to train."]
    return "\n".join(lines + compile_words(rows)) + "\n"
