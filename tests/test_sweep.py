"""keel sweep: grid parsing, equal-parameter widths, the grid runner (cache, resume, stop)."""

import dataclasses
import json
import math
import shutil

import pytest

from conftest import REPO, assert_report_section, tiny_overrides
from keel.config import config_from_dict, load_config
from keel.errors import KeelError
from keel.experiments.grid import GridJob, run_grid
from keel.experiments.presets import run_sweep
from keel.experiments.sweep import (best_over, expand_grid, held_fixed, parse_grid, run_name,
                                    width_for_params)
from keel.model import SCHEMES, Transformer, count_parameters
from keel.train.metrics import read_metrics

DEMO = str(REPO / "keel" / "configs" / "demo.toml")


def test_parse_and_expand_grid():
    grid = parse_grid(["model.residual=keel,pre_ln", "model.n_layers=4,16,64", "train.lr=1e-3,3e-3"])
    assert grid == {"model.residual": ["keel", "pre_ln"], "model.n_layers": [4, 16, 64], "train.lr": [1e-3, 3e-3]}
    assert isinstance(grid["model.n_layers"][0], int) and isinstance(grid["train.lr"][0], float)
    points = expand_grid(grid)
    assert len(points) == 2 * 3 * 2
    assert points[0] == {"model.residual": "keel", "model.n_layers": 4, "train.lr": 1e-3}
    assert points[1] == {"model.residual": "keel", "model.n_layers": 4, "train.lr": 3e-3}
    assert points[-1] == {"model.residual": "pre_ln", "model.n_layers": 64, "train.lr": 3e-3}
    names = [run_name(p) for p in points]
    assert len(set(names)) == len(names)
    assert run_name({"model.residual": "keel", "model.n_layers": 32, "train.lr": 0.003}) == "keel_L64_lr0.003"
    for bad in (["model.residual"], ["residual=keel"], ["train.lr=1e-3,,3e-3"], ["train.lr=1e-3,1e-3"]):
        with pytest.raises(KeelError):
            parse_grid(bad)


def test_a_grid_key_given_twice_is_refused_and_a_text_key_keeps_its_text():
    """`--grid model.n_layers=2 --grid model.n_layers=4` swept only 4 (the later list won, silently)."""
    with pytest.raises(KeelError, match=r"^--grid model.n_layers is given twice; give all its values in one: "
                                        r"--grid model.n_layers=v1,v2,...$"):
        parse_grid(["model.n_layers=2", "train.lr=1e-3", "model.n_layers=4"])
    assert parse_grid(["train.sample_prompt=3.10,1e3", "train.lr=1e-3,3.10"]) == {
        "train.sample_prompt": ["3.10", "1e3"], "train.lr": [1e-3, 3.1]}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("n_layers,d_model", [(2, 32), (5, 48)])
def test_param_count_matches_model(scheme, n_layers, d_model):
    cfg = load_config(None, [f"model.residual={scheme}", f"model.n_layers={n_layers}", f"model.d_model={d_model}",
                             "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=96", "model.vocab_size=300"]).model
    model = Transformer(cfg)
    assert count_parameters(cfg) == model.num_params()
    assert count_parameters(cfg, non_embedding=True) == model.num_params(non_embedding=True)


@pytest.mark.parametrize("scheme", ["keel", "pre_ln"])
def test_width_for_params_holds_parameters(scheme):
    base = load_config(None, [f"model.residual={scheme}", "model.n_layers=4", "model.d_model=128", "model.n_heads=2",
                              "model.n_kv_heads=1", "model.d_ff=384", "model.vocab_size=1024"]).model
    target = count_parameters(base, non_embedding=True)
    assert width_for_params(base, target).d_model == 128  # the base shape is its own answer
    for n_layers, tol in ((1, 0.05), (12, 0.05)):
        m = width_for_params(base, target, n_layers)
        got = count_parameters(m, non_embedding=True)
        assert m.n_layers == n_layers and m.d_model % 4 == 0 and m.d_ff == round(3 * m.d_model)
        assert abs(got - target) / target < tol, (n_layers, m.d_model, got, target)
        for d in (m.d_model - 4, m.d_model + 4):  # no neighbouring width is closer
            if d > 0:
                other = count_parameters(dataclasses.replace(m, d_model=d, d_ff=round(3 * d)), non_embedding=True)
                assert abs(other - target) >= abs(got - target)
    assert width_for_params(base, target, 16).d_model < 128 < width_for_params(base, target, 1).d_model
    # the narrowest width (d_model 4 here) answers a target under it only while it is the nearer of it and no
    # model: `keel sweep --match-params 1` planned the narrowest model without a word (a typo for 1M)
    narrow = count_parameters(dataclasses.replace(base, d_model=4, d_ff=12), non_embedding=True)
    assert width_for_params(base, narrow // 2 + 1).d_model == 4
    with pytest.raises(KeelError, match=rf"^{narrow // 2 - 1:,} parameters are under half the narrowest model's: "
                                        rf"d_model 4 at 4 blocks has {narrow:,}$"):
        width_for_params(base, narrow // 2 - 1)


def _tiny_sets(tiny_data, drop=("train.lr",), **train):
    """:func:`tiny_overrides` of 8 steps, less ``drop`` (the grid's keys: a --set of one is refused)."""
    t = dict(steps=8, checkpoint_every=4, eval_every=4)
    t.update(train)
    return tiny_overrides(tiny_data, drop, **t)


def test_sweep_tables_best_lr_and_cache(tiny_data, tmp_path, caplog):
    out = tmp_path / "sw"
    grid = parse_grid(["model.residual=keel,pre_ln", "train.lr=1e-3,1e-2"])
    s = run_sweep(DEMO, grid, _tiny_sets(tiny_data), out=out, workers=0, best="train.lr")
    runs = s["runs"]
    assert [r["name"] for r in runs] == ["keel_lr0.001", "keel_lr0.01", "pre_ln_lr0.001", "pre_ln_lr0.01"]
    for r in runs:
        recs = read_metrics(out / r["name"] / "metrics.jsonl")
        vals = [x["val_loss"] for x in recs if "val_loss" in x]
        assert r["status"] == "done" and r["verdict"] == "healthy" and r["step"] == 8
        assert r["final_val_loss"] == vals[-1] and r["best_val_loss"] == min(vals)
        assert r["tokens"] == 8 * 4 * 32
        assert r["params"] == Transformer(load_config(out / r["name"] / "config.toml").model).num_params()
    assert s["held_fixed"]["tokens"] == 8 * 4 * 32 and s["held_fixed"]["steps"] == 8
    assert s["held_fixed"]["params"] == "varies"  # Keel has two norms per sub-layer, Pre-LN one
    assert held_fixed([]) == {}  # no finished run: nothing is known to vary (it said "varies" for each)
    one = {"planned_tokens": 8, "steps": 2, "params": 10}
    assert held_fixed([one, {**one, "params": 11}]) == {"tokens": 8, "steps": 2, "params": "varies"}
    for scheme in ("keel", "pre_ln"):
        mine = [r for r in runs if r["values"]["model.residual"] == scheme]
        want = min(mine, key=lambda r: r["final_val_loss"])
        row = next(b for b in s["best"] if b["values"] == {"model.residual": scheme})
        assert row["best"] == want["values"]["train.lr"] and row["final_val_loss"] == want["final_val_loss"]
    md = (out / "sweep.md").read_text()
    assert "Held fixed:** tokens = 1,024, steps = 8" in md and "best train.lr" in md
    assert json.loads((out / "sweep.json").read_text())["best"] == s["best"]
    assert_report_section(out, "sweep", "sweep")  # the one report: the sweep table is a section of report.md

    # a finished sweep is not run again; without --resume a non-empty folder is an error
    before = {r["name"]: (out / r["name"] / "result.json").stat().st_mtime_ns for r in runs}
    caplog.clear()
    with caplog.at_level("INFO", logger="keel"):
        s2 = run_sweep(DEMO, grid, _tiny_sets(tiny_data), out=out, workers=0, resume=True)
    assert any("4 finished already, 0 to run" in m for m in caplog.messages)
    assert {r["name"]: (out / r["name"] / "result.json").stat().st_mtime_ns for r in s2["runs"]} == before
    with pytest.raises(KeelError, match="--resume"):
        run_sweep(DEMO, grid, _tiny_sets(tiny_data), out=out, workers=0)

    # an interrupted run (checkpoint at step 4, no result) is resumed and ends where it would have
    name = "pre_ln_lr0.01"
    final = next(r for r in runs if r["name"] == name)["final_val_loss"]
    rd = out / name
    (rd / "result.json").unlink()
    shutil.rmtree(rd / "checkpoints" / "step_00000008")
    (rd / "checkpoints" / "latest").write_text("step_00000004")
    caplog.clear()
    with caplog.at_level("INFO", logger="keel"):
        s3 = run_sweep(DEMO, grid, _tiny_sets(tiny_data), out=out, workers=0, resume=True)
    assert any("3 finished already, 1 to run" in m for m in caplog.messages)
    assert "resuming" in (rd / "run.log").read_text()
    again = next(r for r in s3["runs"] if r["name"] == name)
    assert again["step"] == 8 and again["final_val_loss"] == pytest.approx(final, rel=1e-6)
    assert [x["step"] for x in read_metrics(rd / "metrics.jsonl")] == list(range(9))

    # a changed config under the same name is refused, with the way to continue it (the message said
    # "remove it", advice that throws finished runs away where the user had only left out a --set)
    with pytest.raises(KeelError, match="other settings \\(train.warmup_steps\\); continue it with the settings in "
                       "its job.json \\(e.g. the same --set flags\\), or use another --out"):
        (rd / "result.json").unlink()
        run_sweep(DEMO, grid, _tiny_sets(tiny_data, warmup_steps=1), out=out, workers=0, resume=True)


def test_stopped_run_is_a_result_and_excluded_from_best(tiny_data, tmp_path):
    """Post-LN with N(0, 1e20^2) weights overflows fp32 (its attention reads the raw stream):
    every step is non-finite, the trainer stops the run after train.max_bad_steps; the sweep
    records it and goes on (worker process). (Pre-LN no longer serves: its RMSNorm of an
    overflowing stream is 0, so it trains nothing but stays finite.)"""
    grid = parse_grid(["model.init_std=0.02,1e20"])
    sets = _tiny_sets(tiny_data, (), max_bad_steps=2) + ["model.residual=post_ln"]
    s = run_sweep(DEMO, grid, sets, out=tmp_path / "sw", workers=1, threads=1, best="model.init_std")
    ok, bad = s["runs"]
    assert ok["verdict"] == "healthy" and ok["step"] == 8
    assert bad["status"] == "done" and bad["verdict"] == "instability" and bad["diverged"]
    assert bad["step"] == 2 and bad["final_val_loss"] is None and "max_bad_steps" in bad["stopped"]
    assert s["best"][0]["best"] == 0.02 and s["best"][0]["n_ok"] == 1


def _fail_task(job, run_dir, resume):
    if job.values["x"] == 2:
        raise KeelError("boom")
    return {"square": job.values["x"] ** 2, **({"note": "odd one"} if job.values["x"] == 3 else {})}


def test_grid_runner_records_errors_and_retries_them(tmp_path, caplog):
    jobs = [GridJob(f"x{x}", {"x": x}, {"x": x}) for x in (1, 2, 3)]
    res = run_grid(jobs, tmp_path / "g", _fail_task, workers=0)
    assert [r["status"] for r in res] == ["done", "error", "done"]
    assert res[0]["square"] == 1 and res[2]["square"] == 9 and res[1]["message"] == "boom"
    assert not (tmp_path / "g" / "x2" / "result.json").exists()
    with caplog.at_level("INFO", logger="keel"):
        run_grid(jobs, tmp_path / "g", _fail_task, workers=0, resume=True)
    assert any("2 finished already, 1 to run" in m for m in caplog.messages)
    with caplog.at_level("INFO", logger="keel"):
        run_grid(jobs[2:], tmp_path / "n", _fail_task, workers=0)
    assert any(m.startswith("[1/1] x3: done; odd one (") for m in caplog.messages)  # a task's note is shown
    with pytest.raises(KeelError, match="repeated"):
        run_grid(jobs + jobs[:1], tmp_path / "h", _fail_task, workers=0)
    with pytest.raises(KeelError, match="folder name"):
        run_grid([GridJob("a/b", {})], tmp_path / "h", _fail_task, workers=0)


def test_best_over_needs_a_grid_key():
    with pytest.raises(KeelError, match="best-over"):
        best_over([], ["model.residual"], "train.lr")


def test_cli_errors(keel_main, tmp_path, tiny_data):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    r = keel_main("sweep", "--grid", "train.lr=1e-3,2e-3", "--out", tmp_path / "full",
                 *sum((["--set", s] for s in _tiny_sets(tiny_data)), []))
    # a folder of other files: named, and --resume (refused there too) is not advised
    assert r.returncode == 2 and "holds no study (no study.json); give an empty or new --out" in r.stderr
    assert "--resume" not in r.stderr and "Traceback" not in r.stderr
    r = keel_main("sweep", "--grid", "train.lr=1e-3", "--best-over", "model.residual", "--out", tmp_path / "o",
                 *sum((["--set", s] for s in _tiny_sets(tiny_data)), []))
    assert r.returncode == 2 and "--best-over model.residual" in r.stderr
    r = keel_main("sweep", "--preset", "no-such-preset")
    assert r.returncode == 2 and "unknown sweep preset" in r.stderr


def test_resume_alone_continues_the_sweep_its_folder_holds(keel_main, tmp_path, tiny_data):
    """`keel sweep --out DIR --resume` said "nothing to sweep: give --grid": every --grid and --set
    had to be typed again. It takes them from the command that started DIR (study.json)."""
    out = tmp_path / "sw"
    sets = sum((["--set", s] for s in _tiny_sets(tiny_data, steps=2, eval_every=2)), [])
    first = keel_main("sweep", "--grid", "train.lr=1e-3,2e-3", "--out", out, *sets)
    assert first.returncode == 0, first.stderr
    done = (out / "lr0.002" / "result.json").read_text()
    shutil.rmtree(out / "lr0.001")  # as if stopped before its first run finished
    again = keel_main("sweep", "--out", out, "--resume")
    assert again.returncode == 0, again.stderr
    assert (out / "lr0.001" / "result.json").is_file() and (out / "lr0.002" / "result.json").read_text() == done
    assert json.loads((out / "sweep.json").read_text())["grid"] == {"train.lr": [0.001, 0.002]}
    other = keel_main("sweep", "--out", tmp_path / "none", "--resume")  # a mistyped folder: said "give --grid"
    assert other.returncode == 2 and f"--resume: {tmp_path / 'none'} does not exist, nothing to continue" in other.stderr
    # another grid in the same folder was trained on the demo preset, dropping the sweep's --set (a new-user trial)
    before = sorted(p.name for p in out.iterdir())
    for flags in (["--grid", "train.lr=1e-2"], ["--grid", "train.lr=1e-3,2e-3", "--best-over", "train.lr"]):
        mixed = keel_main("sweep", "--out", out, "--resume", *flags)
        assert mixed.returncode == 2 and "--resume continues the sweep" in mixed.stderr, mixed.stderr
        assert "Traceback" not in mixed.stderr and sorted(p.name for p in out.iterdir()) == before
    same = keel_main("sweep", "--out", out, "--resume", "--grid", "train.lr=1e-3,2e-3", *sets)
    assert same.returncode == 0, same.stderr


def test_a_base_config_valid_only_with_the_grids_values_is_swept(keel_main, tmp_path, tiny_data):
    """`keel sweep --grid model.loop_core=1 --set model.loop_repeats=2` was refused before any grid value
    was applied ("model.loop_repeats = 2 needs a loop: set model.loop_core >= 1"): the base config was
    checked alone. Each grid point's config is checked whole now; a point that breaks the rule is still
    refused, as is --match-params auto, whose target is the base config's own count."""
    loop = ["--set", "model.loop_prelude=1", "--set", "model.loop_repeats=2"]
    out = tmp_path / "sw"
    r = keel_main("sweep", "--grid", "model.loop_core=1", "--out", out, *loop,
                  *sum((["--set", s] for s in _tiny_sets(tiny_data, steps=2, eval_every=2)), []))
    assert r.returncode == 0, r.stderr
    run = json.loads((out / "report.json").read_text())["group_tables"]["sweep"]["runs"][0]
    assert run["values"] == {"model.loop_core": 1} and run["status"] == "done" and run["step"] == 2
    cfg = load_config(out / "loop_core1" / "config.toml", stored=True).model
    assert (cfg.loop_prelude, cfg.loop_core, cfg.loop_repeats, cfg.n_layers) == (1, 1, 2, 2)
    bad = keel_main("sweep", "--grid", "model.loop_core=0,1", "--out", tmp_path / "bad", *loop, "--dry-run")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "keel: error: model.loop_prelude = 1 needs a loop: set model.loop_core >= 1"], bad.stderr
    auto = keel_main("sweep", "--grid", "model.loop_core=1,2", "--set", "model.n_layers=4", *loop, "--match-params",
                     "auto", "--out", tmp_path / "auto", "--dry-run")
    assert auto.returncode == 2 and auto.stderr.strip().splitlines() == [
        "keel: error: --match-params auto matches the base config's non-embedding parameter count, but the base "
        "config is not valid without the grid's values (model.loop_prelude = 1 needs a loop: set model.loop_core "
        ">= 1): give --match-params a count, or --set the keys that make the base valid"], auto.stderr
    counted = keel_main("sweep", "--grid", "model.loop_core=1,2", "--set", "model.n_layers=4", *loop,
                        "--match-params", "40000", "--out", tmp_path / "count", "--dry-run")
    assert counted.returncode == 0 and "| sweep | 2 | keel | 10, 12 |" in counted.stdout, counted.stderr
    assert not (tmp_path / "bad").exists() and not (tmp_path / "auto").exists()


@pytest.mark.parametrize("preset", ["cpu-depth", "deep-vs-wide", "paper-depth", "paper-deep-vs-wide"])
def test_presets_build(preset):
    from keel.experiments.presets import load_sweep_preset
    from keel.experiments.sweep import build_jobs

    p = load_sweep_preset(preset)
    sets = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in p["set"]]
    jobs = build_jobs(p.get("base"), p["grid"], sets, match_params=p.get("match_params"))
    assert len(jobs) == math.prod(len(v) for v in p["grid"].values())
    if p.get("match_params"):
        counts = [count_parameters(config_from_dict(j.config).model, non_embedding=True) for j in jobs]
        # width moves in steps of 2 * n_heads: coarse at CPU widths (~40), fine at the paper's (~1024)
        assert max(counts) / min(counts) < (1.02 if preset.startswith("paper") else 1.10), counts



def test_match_params_with_an_auto_vocab_uses_the_vocabulary_known_before_the_data(tiny_data):
    """--match-params with model.vocab_size "auto" (the demo config's) failed with a message naming
    a Python API: the LM head is in the count, so the vocabulary is taken from data.path's
    meta.json or bpe:N; a hub tokenizer, sized only once prepared, is one line naming the keys."""
    from keel.data import read_meta
    from keel.experiments.sweep import build_jobs

    grid = {"model.n_layers": [2, 4]}
    bpe = build_jobs(None, grid, ["data.tokenizer=bpe:1000"], match_params="auto")
    assert [j.config["model"]["vocab_size"] for j in bpe] == [1024, 1024]  # 1000 rounded up to a multiple of 64
    want = count_parameters(load_config(None, ["model.vocab_size=1024"]).model, non_embedding=True)
    counts = [count_parameters(config_from_dict(j.config).model, non_embedding=True) for j in bpe]
    assert all(abs(c / want - 1) < 0.1 for c in counts), (counts, want)
    prepared = build_jobs(None, grid, [], match_params="auto", data_path=str(tiny_data))
    assert {j.config["model"]["vocab_size"] for j in prepared} == {read_meta(tiny_data)["vocab_size"]} == {512}
    with pytest.raises(KeelError, match=r"^--match-params needs the vocabulary size .* data.tokenizer 'gpt2' is sized "
                                        r"only once prepared; set model.vocab_size or data.path$"):
        build_jobs(None, grid, ["data.tokenizer=gpt2"], match_params=1_000_000)
    for bad in ("-5", "0.4", "1e400"):  # named by the flag (it read "parameter target must be >= 1, got -5")
        with pytest.raises(KeelError, match=rf"^--match-params must be a parameter count( >= 1)? (or 'auto')?.*"
                                            rf"got '{bad}'$"):
            build_jobs(None, grid, ["data.tokenizer=bpe:1000"], match_params=bad)


def test_sweep_table_with_a_blown_up_loss():
    """A final validation loss above ~709 nats made math.exp overflow (OverflowError) in the
    sweep report; the perplexity is now the trainer's capped one (inf)."""
    from keel.experiments.sweep import sweep_markdown

    run = {"values": {"train.lr": 1.0}, "status": "done", "final_val_loss": 800.0, "best_val_loss": 9.0,
           "tokens": 512, "step": 4, "params": 1e6, "non_embedding_params": 5e5, "wall_s": 1.0, "verdict": "instability"}
    summary = {"grid_keys": ["train.lr"], "held_fixed": {}, "out": "o", "config": "demo", "sets": [], "runs": [run],
               "best": [{"values": {}, "best": 1.0, "final_val_loss": 800.0, "n_ok": 1, "n": 1}],
               "best_over": "train.lr"}
    md = sweep_markdown(summary)
    assert "| 800.0000 | 9.0000 | inf |" in md
    # the depth unit is explained only under a table with a depth column (it was under every sweep's)
    assert "(evaluations included)." in md and "depth is blocks" not in md
    deep = dict(summary, grid_keys=["model.n_layers"], runs=[dict(run, values={"model.n_layers": 4})])
    assert "(evaluations included); depth is blocks (sub-layers)." in sweep_markdown(deep)
    assert "| 4 (8) | 800.0000 |" in sweep_markdown(deep)


def test_a_sweep_plan_names_its_schemes_depths_seeds_and_lrs(tmp_path):
    """`keel sweep --dry-run` printed a row with blank schemes, sub-layers, seeds and LRs (a
    sweep group declares none: they are its runs' values)."""
    plan = run_sweep(None, {"model.n_layers": [2, 4], "model.residual": ["keel", "pre_ln"], "train.lr": [1e-3, 3e-3]},
                     ["train.seed=7"], out=tmp_path / "s", dry_run=True)
    (row,) = plan["plan"]
    assert (row["runs"], row["schemes"], row["sublayers"], row["seeds"], row["lr_plan"]) == (
        8, ["keel", "pre_ln"], [4, 8], [7], "0.001, 0.003")
    assert "| sweep | 8 | keel, pre_ln | 4, 8 | 7 | 0.001, 0.003 |" in plan["markdown"]


def test_a_resume_with_the_full_flags_lists_each_set_once(tmp_path):
    """`keel sweep ... --resume` with the flags it started with: every --set was listed twice (the stored
    command's, then the same again), in the report's overrides line too."""
    import shlex

    from keel.cli import build_parser
    from keel.cli.commands.science import stored_flags

    def _stored_sweep(args):
        return stored_flags(args, args.out, "sweep", ("grid", "preset", "config", "best_over", "match_params"))

    argv = ["sweep", "--set", "train.steps=5", "--grid", "train.seed=0", "--out", str(tmp_path)]
    (tmp_path / "study.json").write_text(json.dumps({"study": "sweep", "scale": "cli",
                                                     "command": shlex.join(["keel", *argv])}))
    assert _stored_sweep(build_parser().parse_args([*argv, "--resume"])).set == ["train.steps=5"]
    assert _stored_sweep(build_parser().parse_args(["sweep", "--out", str(tmp_path), "--resume"])).set == \
        ["train.steps=5"]
    assert _stored_sweep(build_parser().parse_args([*argv, "--resume", "--set", "train.steps=6"])).set == \
        ["train.steps=5", "train.steps=6"]


# the run names `keel sweep --preset cpu-depth --dry-run` planned before the presets became study files
CPU_DEPTH_RUNS = [f"lr{lr}_{s}_L{L}" for lr in ("0.002", "0.006") for s in ("keel", "pre_ln", "post_ln")
                  for L in (8, 16, 32, 64)]

OLD_CPU_DEPTH = '''base = "demo"
best_over = "train.lr"

[grid]
"train.lr" = [2e-3, 6e-3]
"model.residual" = ["keel", "pre_ln", "post_ln"]
"model.n_layers" = [4, 8, 16, 32]

[set]
"data.tokenizer" = "bpe:1024"
"data.max_bytes" = 6000000
"data.val_fraction" = 0.05
"model.vocab_size" = 1024
"model.d_model" = 64
"model.n_heads" = 4
"model.n_kv_heads" = 2
"model.d_ff" = 192
"model.max_seq_len" = 128
"model.init_std" = 0.08
"train.steps" = 160
"train.warmup_steps" = 16
"train.batch_size" = 8
"train.seq_len" = 64
"train.eval_every" = 40
"train.eval_tokens" = 8192
"train.checkpoint_every" = 80
"train.sample_tokens" = 16
'''


def _planned(preset, out, monkeypatch):
    """The (run name, config) pairs `keel sweep --preset PRESET --dry-run` plans (the engine's planned jobs)."""
    import keel.experiments.study.plan as engine
    from keel.cli import main

    got, plan = [], engine.planned_jobs

    def spy(*a, **k):
        jobs = plan(*a, **k)
        got.append([(j.name, j.config) for _, _, js in jobs for j in js])
        return jobs

    monkeypatch.setattr(engine, "planned_jobs", spy)
    assert main(["sweep", "--preset", str(preset), "--dry-run", "--out", str(out)]) == 0
    return got[-1]


def test_a_sweep_preset_is_a_study_file_planning_the_runs_it_always_planned(tmp_path, monkeypatch, caplog):
    """The packaged sweep presets are study files ([groups.sweep] of kind "grid"), read by the study
    reader; cpu-depth plans the run names it planned as an old-format file. An old-format file (a
    user's own, by path) still loads, with one warning naming the format and how to convert it, and
    plans the same runs as its converted form."""
    from keel.experiments.presets import load_sweep_preset

    text = (REPO / "keel" / "configs" / "sweeps" / "cpu-depth.toml").read_text()
    assert "[groups.sweep]" in text and 'kind = "grid"' in text and "\n[grid]" not in text
    new = _planned("cpu-depth", tmp_path / "new", monkeypatch)
    assert [name for name, _ in new] == CPU_DEPTH_RUNS
    old_file = tmp_path / "my-sweep.toml"
    old_file.write_text(OLD_CPU_DEPTH)
    caplog.clear()
    with caplog.at_level("WARNING", logger="keel"):
        old = _planned(old_file, tmp_path / "old", monkeypatch)
    warned = [m for m in caplog.messages if "old sweep-preset format" in m]
    assert len(warned) == 1 and "[groups.sweep]" in warned[0] and 'kind = "grid"' in warned[0], caplog.messages
    assert old == new
    with caplog.at_level("WARNING", logger="keel"):
        assert load_sweep_preset(str(old_file)) == load_sweep_preset("cpu-depth")


def test_a_sweep_preset_that_is_not_one_grid_group_is_one_line(tmp_path, keel_main):
    """A sweep preset with a train group, or a grid group with a key it does not read: one line, exit 2."""
    two = tmp_path / "two.toml"
    two.write_text('[groups.a]\nschemes = ["keel"]\nsublayers = [4]\nseeds = [0]\nlrs = [1e-3]\n')
    r = keel_main("sweep", "--preset", two, "--dry-run", "--out", tmp_path / "o")
    assert r.returncode == 2 and 'a sweep preset is a study of one group of kind "grid"' in r.stderr
    assert "Traceback" not in r.stderr
    stray = tmp_path / "stray.toml"
    stray.write_text('[groups.sweep]\nkind = "grid"\nschemes = ["keel"]\ngrid = { "train.lr" = [1e-3] }\n')
    r = keel_main("sweep", "--preset", stray, "--dry-run", "--out", tmp_path / "o")
    assert r.returncode == 2 and "schemes belong(s) to a group of schemes x sub-layers x seeds" in r.stderr, r.stderr
    empty = tmp_path / "empty.toml"
    empty.write_text('[groups.sweep]\nkind = "grid"\ngrid = { "train.lr" = [] }\n')
    r = keel_main("sweep", "--preset", empty, "--dry-run", "--out", tmp_path / "o")
    assert r.returncode == 2 and "grid 'train.lr' must be a non-empty list" in r.stderr, r.stderr


def test_a_one_size_study_file_needs_no_scale(tmp_path, keel_main):
    """`keel study FILE` for a file without [scales] (one size, as a sweep preset) took no run without
    `--scale` (argparse: "the following arguments are required"); it now plans at the scale "default"
    (the out folder's name), and a study that declares scales asks for one in one line."""
    out = tmp_path / "o"
    r = keel_main("study", REPO / "keel/configs/sweeps/cpu-depth.toml", "--dry-run", "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Study cpu-depth, scale default:") and "| sweep | 24 |" in r.stdout
    r = keel_main("study", "claims", "--dry-run", "--out", out)
    assert r.returncode == 2 and r.stderr == ("keel: error: study 'claims' has scales (tiny, cpu, gpu-1, paper): "
                                              "give one with --scale\n"), r.stderr
    assert not out.exists()


def test_a_study_with_a_grid_group_reports_the_sweep_table(tiny_data, tmp_path, keel_main):
    """`keel study` on a study file with a grid group (no [scales]: sized in place, as a sweep preset)
    writes the same section `keel sweep` does: the group's sweep table in report.md, its data in
    report.json. Its own set names the data (data.path): its runs train on that, not on the base's."""
    from keel.experiments.sweep import sweep_markdown

    sets = ", ".join(f'"{k}" = {json.dumps(v)}' for k, v in (s.split("=", 1) for s in _tiny_sets(tiny_data)))
    study = tmp_path / "grid-study.toml"
    study.write_text(f'base = "demo"\n[groups.lrs]\nkind = "grid"\nbest_over = "train.lr"\n'
                     f'grid = {{ "train.lr" = [1e-3, 1e-2] }}\nset = {{ {sets} }}\n')
    out = tmp_path / "st"
    r = keel_main("study", study, "--scale", "cpu", "--workers", "0", "--out", out)
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "report.json").read_text())["group_tables"]["lrs"]
    assert [x["name"] for x in data["runs"]] == ["lr0.001", "lr0.01"] and data["best_over"] == "train.lr"
    assert data["best"][0]["best"] in (1e-3, 1e-2)
    md = (out / "report.md").read_text()
    section = "\n".join("##" + x if x.startswith("#") else x for x in sweep_markdown(data).rstrip("\n").split("\n"))
    assert "## Group lrs: sweep" in md and section in md


def test_restored_runs_of_a_grid_group_keep_best_loss_steps_and_params_in_the_sweep_table(tiny_data, tmp_path,
                                                                                         keel_main):
    """`keel study --restore REPORT_JSON` showed the restored runs of a grid group with dashes for best val,
    steps, params and non-emb (and "Held fixed: not known"): a restored record keeps no result file. They come
    from the record now: the best validation loss and the steps done from its loss curve, the planned steps,
    tokens and the parameter counts from the config the study plans for the run, as the trained run had them."""
    sets = ", ".join(f'"{k}" = {json.dumps(v)}' for k, v in (s.split("=", 1) for s in _tiny_sets(tiny_data, steps=4,
                                                                                                    eval_every=2)))
    study = tmp_path / "grid-study.toml"
    study.write_text(f'base = "demo"\n[groups.lrs]\nkind = "grid"\ngrid = {{ "train.lr" = [1e-3, 1e-2] }}\n'
                     f'set = {{ {sets} }}\n')
    r = keel_main("study", study, "--scale", "cpu", "--workers", "0", "--out", tmp_path / "st")
    assert r.returncode == 0, r.stderr
    trained = json.loads((tmp_path / "st" / "report.json").read_text())["group_tables"]["lrs"]
    again = keel_main("study", study, "--scale", "cpu", "--workers", "0", "--out", tmp_path / "again",
                      "--restore", tmp_path / "st" / "report.json")
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "again" / "lrs").exists()  # nothing trained: both runs restored
    restored = json.loads((tmp_path / "again" / "report.json").read_text())["group_tables"]["lrs"]
    keys = ("step", "steps", "tokens", "planned_tokens", "params", "non_embedding_params")
    for old, new in zip(trained["runs"], restored["runs"], strict=True):
        assert {k: new[k] for k in keys} == {k: old[k] for k in keys}
        assert old["step"] == 4 and old["params"] > 0
        assert new["best_val_loss"] == pytest.approx(old["best_val_loss"], abs=1e-5)  # the curve keeps 5 decimals
    assert restored["held_fixed"] == trained["held_fixed"] and trained["held_fixed"]["steps"] == 4
    md = (tmp_path / "again" / "report.md").read_text()
    row = next(x for x in md.splitlines() if x.startswith("| 0.001 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    old_row = next(x for x in (tmp_path / "st" / "report.md").read_text().splitlines() if x.startswith("| 0.001 |"))
    old_cells = [c.strip() for c in old_row.strip("|").split("|")]
    assert "—" not in cells[:9] and cells[:8] == old_cells[:8], (row, old_row)  # all but wall s and verdict


def test_restored_summary_derives_what_a_record_and_its_planned_config_give(tiny_data):
    """The numbers of a restored run: steps done from its tokens (else its curve's last step), the best
    validation loss from its curve, the parameter counts where the vocabulary is known (a number, or the
    prepared dataset of an "auto" one); none where it is not."""
    from keel.experiments.sweep import restored_summary

    cfg = load_config(None, tiny_overrides(tiny_data, steps=6))  # 4 x 32 tokens a step, vocab 512
    curve = {"step": [1, 3, 5], "loss": [6.0, 5.0, 4.5], "lr": [1e-3] * 3, "val_step": [0, 4, 6],
             "val_loss": [6.2, 4.9, 5.1]}
    got = restored_summary(cfg.to_dict(), 640, curve)
    assert {k: got[k] for k in ("step", "steps", "planned_tokens", "best_val_loss", "blocks", "sublayers")} == {
        "step": 5, "steps": 6, "planned_tokens": 768, "best_val_loss": 4.9, "blocks": 2, "sublayers": 4}
    assert got["params"] == count_parameters(cfg.model) and got["non_embedding_params"] == count_parameters(
        cfg.model, non_embedding=True)
    assert restored_summary(cfg.to_dict(), None, curve)["step"] == 6  # the last validation step
    auto = load_config(None, [s for s in tiny_overrides(tiny_data) if not s.startswith("model.vocab_size")])
    sized = restored_summary(auto.to_dict(), None, None)
    assert auto.model.vocab_size == "auto" and sized["params"] == count_parameters(
        dataclasses.replace(auto.model, vocab_size=512))  # the dataset's 512 tokens, a multiple of 64
    unknown = restored_summary(load_config(None, ["model.vocab_size=auto", "data.path="]).to_dict(), None, None)
    assert "params" not in unknown and "step" not in unknown and "best_val_loss" not in unknown
