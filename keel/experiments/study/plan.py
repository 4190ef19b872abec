"""The ``keel study --dry-run`` plan in words: GPU-hours, the totals and the
markdown table (the rows come from :func:`keel.experiments.study.run.plan_rows`)."""

from __future__ import annotations

from keel.experiments.study.spec import Study
from keel.experiments.table import markdown_table


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
    :func:`keel.experiments.study.run.plan_rows`), else what :data:`COMPILE_CPU_S` adds per run and in all."""
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


def cpu_hours(tokens: float, flops: float) -> float:
    """Estimated CPU-hours (one core per run) of training ``tokens`` tokens at ``flops`` training FLOPs in all:
    ``(tokens * CPU_S_PER_TOKEN + flops / CPU_FLOPS) / 3600`` (:data:`CPU_S_PER_TOKEN`, :data:`CPU_FLOPS`)."""
    return (tokens * CPU_S_PER_TOKEN + flops / CPU_FLOPS) / 3600


def plan_total(rows: list[dict]) -> dict:
    """The sums of :func:`keel.experiments.study.run.plan_rows`' ``runs``, ``references``, ``tokens``,
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
              ", ".join(f"{L}: {x:.3g}" for L, x in r.get("tokens_per_param", {}).items()) or "–",
              f"{r['tokens']:.3g}", hours_words(r["gpu_hours"]), hours_words(r["cpu_hours"])] for r in rows]
    lines = [f"Study {study.name}, scale {study.scale}: {study.note}".strip(), ""] + markdown_table(
        ["group", "runs", "schemes", "sub-layers", "seeds", "LRs", "steps", "tokens per run",
         "tokens per non-embedding parameter, by depth", "total tokens", "est. GPU-hours", "est. CPU-hours"], cells)
    tot = plan_total(rows)
    lines += ["", f"Total: {tot['runs'] + tot['references']} runs, "
                  f"{tot['tokens']:.3g} tokens, about {hours_words(tot['gpu_hours'])} GPU-hours "
                  f"(training FLOPs 6N + 12 n_layers d T per token, PaLM App. B, at {mfu:.0%} MFU of "
                  f"{peak_tflops:g} TFLOP/s dense bf16{', an H100 SXM' if peak_tflops == 989 else ''}; "
                  f"evaluation not counted), or about {hours_words(tot['cpu_hours'])} CPU-hours on one core per run "
                  "(fitted to the cpu claims study's runs at width 64: keel.experiments.study.plan.cpu_hours)."]
    if restore is not None:
        lines += ["", f"{tot['restored']} of these runs are restored from {restore} and would not train: "
                      f"about {hours_words(tot['gpu_hours_left'])} GPU-hours are left to train."]
    return "\n".join(lines + compile_words(rows)) + "\n"
