"""The ``keel study --dry-run`` plan in words: a group's LRs, GPU-hours, the totals and the
markdown table (the rows come from :func:`keel.experiments.study.run.plan_rows`)."""

from __future__ import annotations

from keel.experiments.study.spec import Group, Study


def lr_plan_words(g: Group) -> str:
    """A group's LRs in words: ``0.0003, 0.001``, ``from lr-grid at 64, grid steps [0, -1]`` (an
    ``lr_from`` group: known once its source has finished) or ``ramp 0 -> 0.05 over 1000 steps``."""
    if g.kind == "ramp":
        return f"ramp 0 -> {g.peak_lr:g} over {g.ramp_steps} steps"
    if g.lr_from:
        return f"from {g.lr_from} at {g.lr_from_sublayers}, grid steps {g.lr_from_steps}"
    return ", ".join(f"{x:g}" for x in g.lrs)


def hours_words(h: float) -> str:
    """GPU-hours for the plan: one decimal, or two significant digits below 1 (a cpu-scale group
    read "0.0")."""
    return f"{h:,.1f}" if h >= 1 else f"{h:.2g}"


def plan_total(rows: list[dict]) -> dict:
    """The sums of :func:`keel.experiments.study.run.plan_rows`' ``runs``, ``references``, ``tokens``,
    ``flops``, ``gpu_hours``, ``restored`` (runs a ``--restore`` report holds) and ``gpu_hours_left``."""
    keys = ("runs", "references", "tokens", "flops", "gpu_hours", "restored", "gpu_hours_left")
    return {k: sum(r[k] for r in rows) for k in keys}


def plan_markdown(study: Study, rows: list[dict], mfu: float, peak_tflops: float, restore: str | None = None) -> str:
    """The ``--dry-run`` table; with ``restore`` (the ``--restore`` report), how many of each group's
    runs it holds and the GPU-hours left to train."""
    lines = [f"Study {study.name}, scale {study.scale}: {study.note}".strip(), "",
             "| group | runs | schemes | sub-layers | seeds | LRs | steps | tokens per run | tokens per non-embedding "
             "parameter, by depth | total tokens | est. GPU-hours |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = f"{r['runs']}" + (f" + {r['references']} ref." if r["references"] else "") \
            + (f" ({r['restored']} restored)" if restore is not None else "")
        lines.append(f"| {r['group']} | {runs} | {', '.join(r['schemes'])} | {', '.join(map(str, r['sublayers']))} | "
                     f"{', '.join(map(str, r['seeds']))} | {r['lr_plan']} | {', '.join(map(str, r.get('steps', [])))} | "
                     f"{', '.join(f'{t:,.0f}' for t in r['tokens_per_run'])} | "
                     + (", ".join(f"{L}: {x:.3g}" for L, x in r.get("tokens_per_param", {}).items()) or "–")
                     + f" | {r['tokens']:.3g} | "
                     f"{hours_words(r['gpu_hours'])} |")
    tot = plan_total(rows)
    lines += ["", f"Total: {tot['runs'] + tot['references']} runs, "
                  f"{tot['tokens']:.3g} tokens, about {hours_words(tot['gpu_hours'])} GPU-hours "
                  f"(training FLOPs 6N + 12 n_layers d T per token, PaLM App. B, at {mfu:.0%} MFU of "
                  f"{peak_tflops:g} TFLOP/s dense bf16{', an H100 SXM' if peak_tflops == 989 else ''}; "
                  "evaluation not counted)."]
    if restore is not None:
        lines += ["", f"{tot['restored']} of these runs are restored from {restore} and would not train: "
                      f"about {hours_words(tot['gpu_hours_left'])} GPU-hours are left to train."]
    return "\n".join(lines) + "\n"
