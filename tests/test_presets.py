"""keel sweep, stress and lr-sensitivity as study presets: one engine plans, records and reports them."""

from pathlib import Path

import pytest
from conftest import REPO

from keel.diagnostics.divergence import Thresholds
from keel.experiments import presets
from keel.experiments.grid import GridJob
from keel.experiments.study.records import run_record
from keel.experiments.study.spec import Group
from keel.config import load_config
from keel.model import SCHEMES

DEMO = str(REPO / "keel" / "configs" / "demo.toml")
SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64", "train.steps=10",
         "train.batch_size=2", "train.seq_len=16", "model.max_seq_len=16"]


def _plan(name, out):
    if name == "sweep":
        sets = [s for s in SMALL if not s.startswith("model.d_model=")]  # the grid sets it (a --set would be refused)
        return presets.run_sweep(DEMO, {"model.residual": ["keel", "pre_ln"], "model.d_model": [32, 64]}, sets,
                                 out=out, dry_run=True)
    if name == "stress":
        sets = [s for s in SMALL if s.split("=")[0] not in presets.STRESS_OWNED]  # --ramp-steps sets train.steps
        return presets.run_stress(DEMO, sets, ["keel", "post_ln"], [4, 8], [0, 1], 5e-2, 10, out, dry_run=True)
    return presets.run_lr_sensitivity(DEMO, ["keel"], [4], [1e-3, 1e-2], [0, 1, 2], SMALL, out=out, dry_run=True)


@pytest.mark.parametrize("name,runs,refs", [("sweep", 4, 0), ("stress", 8, 4), ("lr-sensitivity", 6, 0)])
def test_every_grid_command_plans_with_dry_run_and_writes_nothing(name, runs, refs, tmp_path):
    out = tmp_path / "out"
    plan = _plan(name, out)
    assert (plan["total"]["runs"], plan["total"]["references"]) == (runs, refs)
    # every run trains 10 steps x 2 x 16 tokens; the stress test's references too
    assert plan["total"]["tokens"] == (runs + refs) * 10 * 2 * 16
    assert f"Study {name}, scale cli" in plan["markdown"] and "Total:" in plan["markdown"]
    assert not out.exists()


def test_a_bad_grid_is_refused_before_the_plan(tmp_path):
    with pytest.raises(Exception, match="--best-over train.lr is not one of the grid keys"):
        presets.run_sweep(DEMO, {"model.d_model": [32]}, SMALL, out=tmp_path / "o", best="train.lr", dry_run=True)
    with pytest.raises(Exception, match="unknown scheme 'nope'"):
        presets.run_stress(DEMO, SMALL, ["nope"], [4], [0], 5e-2, 10, tmp_path / "o", dry_run=True)
    assert not (tmp_path / "o").exists()


def test_a_run_record_reads_its_coordinates_from_the_runs_config():
    """A sweep over a key the groups never vary (here the width) still records the run's scheme,
    depth, seed and LR: they come from the run's own config, one vocabulary for every grid."""
    cfg = load_config(DEMO, SMALL + ["model.residual=post_ln", "model.n_layers=3", "train.seed=7", "train.lr=0.02"])
    job = GridJob("d_model32", cfg.to_dict(), {"model.d_model": 32})
    rec = run_record(Group(name="sweep", schemes=[], sublayers=[], seeds=[], kind="grid"), job, Path(), None)
    assert (rec["scheme"], rec["sublayers"], rec["seed"], rec["lr"]) == ("post_ln", 6, 7, 0.02)
    assert rec["values"] == {"model.d_model": 32} and rec["status"] == "pending"


@pytest.mark.parametrize("margin,h1", [(0.05, 5.0), (0.1, 3.2), (0.0, 7.0)])
def test_plateau_level_transcription(margin, h1):
    """The stagnation level of the divergence classifier (Keel paper Sec. 5.1 as keel reads it):
    a loss at or above (1 - margin) x the unigram entropy H1 has learnt only token frequencies."""
    assert Thresholds(stagnation_margin=margin).plateau_level(h1) == pytest.approx(h1 - margin * h1, rel=1e-15)
    assert Thresholds(stagnation_margin=margin).plateau_level(None) is None


@pytest.mark.parametrize("argv", [
    ["sweep", "--config", DEMO, "--grid", "model.residual=keel,pre_ln"],
    ["stress", "--config", DEMO, "--residual", "keel", "--sublayers", "4", "--seeds", "0", "--ramp-steps", "10"],
    ["lr-sensitivity", "--config", DEMO, "--residual", "keel", "--sublayers", "4", "--lrs", "1e-3", "--seeds", "0"],
])
def test_dry_run_flag_of_every_grid_command(argv, tmp_path, capsys):
    from keel.cli import main

    sets = [x for s in SMALL if not s.startswith("train.steps=") for x in ("--set", s)]  # stress: --ramp-steps
    assert main(argv + sets + ["--out", str(tmp_path / "o"), "--dry-run"]) == 0
    assert "est. GPU-hours" in capsys.readouterr().out and not (tmp_path / "o").exists()
    assert main(argv + sets + ["--out", str(tmp_path / "o"), "--dry-run", "--resume"]) == 2  # one line
    assert capsys.readouterr().err.strip() == "keel: error: --dry-run only prints the plan; do not combine it with " \
        "--resume or --report-only"


_UNKNOWN = "keel: error: unknown model.residual {!r} (choose from " + ", ".join(SCHEMES) + ")"


@pytest.mark.parametrize("argv,message", [
    (["sweep", "--grid", "model.residual=keel,preln", "--dry-run"], _UNKNOWN.format("preln")),
    (["sweep", "--set", "model.residual=preln", "--grid", "train.lr=1e-3", "--dry-run"], _UNKNOWN.format("preln")),
    (["sweep", "--grid", "model.residual=preln"], _UNKNOWN.format("preln")),  # not only the plan: the run too
    (["lr-sensitivity", "--residual", "Keel", "--sublayers", "2", "--lrs", "1e-3", "--seeds", "0", "--dry-run"],
     "keel: error: --residual: unknown scheme 'Keel' (available: " + ", ".join(SCHEMES) + ")"),  # named model.residual
    (["stress", "--residual", "keel", "--sublayers", "4", "--seeds", "0", "--set", "train.lr=0.1", "--set",
      "train.seed=5", "--set", "model.residual=pre_ln", "--dry-run"],
     "keel: error: --set train.lr: keel stress sets the LR (its ramp); use --peak-lr"),
    (["stress", "--residual", "keel", "--sublayers", "4", "--seeds", "0", "--set", "train.steps=7", "--dry-run"],
     "keel: error: --set train.steps: keel stress sets the steps (its ramp); use --ramp-steps"),
    (["lr-sensitivity", "--residual", "keel", "--sublayers", "2", "--lrs", "1e-3", "--seeds", "0", "--set",
      "train.lr=0.5", "--set", "train.seed=7", "--dry-run"],
     "keel: error: --set train.lr: keel lr-sensitivity sets each run's LR; use --lrs"),
    (["lr-sensitivity", "--residual", "keel", "--sublayers", "2", "--lrs", "1e-3", "--seeds", "0", "--set",
      "train.seed=7", "--dry-run"], "keel: error: --set train.seed: keel lr-sensitivity sets each run's seed; use --seeds"),
    (["sweep", "--set", "train.lr=0.1", "--grid", "train.lr=1e-3,1e-2", "--dry-run"],
     "keel: error: --set train.lr: keel sweep sets it per run; it is a --grid key"),
])
def test_a_bad_scheme_or_a_set_the_grid_overrides_is_one_line(argv, message, keel_main, tmp_path):
    """A misspelt scheme (once a KeyError traceback from the sweep's job list) and a ``--set`` of a
    key the command sets per run (once silently overridden) are refused in one line, before --out."""
    out = tmp_path / "o"
    r = keel_main(*argv, "--config", DEMO, "--out", out)
    assert r.returncode == 2 and r.stderr.strip() == message
    assert "Traceback" not in r.stderr and not out.exists()


def test_a_sweep_preset_may_fix_the_base_its_grid_varies(keel_main, tmp_path):
    """deep-vs-wide's [set] fixes model.n_layers, the base of its parameter target (match_params
    auto): a typed pair of the preset file, not a user's --set, and so not refused."""
    r = keel_main("sweep", "--preset", "deep-vs-wide", "--out", tmp_path / "o", "--dry-run")
    assert r.returncode == 0, r.stderr
