"""keel plot: loss curves, loss vs depth, loss vs LR, from real (tiny) runs and sweeps."""

import pytest

from conftest import REPO, tiny_overrides
from keel.errors import KeelError
from keel.experiments.plot import depth_points, plot_depth, plot_loss_curves, plot_lr
from keel.experiments.presets import run_sweep
from keel.experiments.sweep import load_sweep, parse_grid
from keel.train.metrics import trailing_mean


@pytest.fixture(scope="module")
def sweep_dir(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("plots") / "sw"
    grid = parse_grid(["model.residual=keel,pre_ln", "model.n_layers=1,2", "train.lr=1e-3,1e-2"])
    sets = tiny_overrides(tiny_data, ("model.n_layers", "train.lr"), steps=4, eval_every=2, checkpoint_every=4)
    run_sweep(str(REPO / "keel" / "configs" / "demo.toml"), grid, sets, out=out, workers=0, best="train.lr")
    return out


@pytest.mark.parametrize("window", [0, 1, 2, 3, 10])
def test_smoothing_is_the_trailing_mean(window):
    """``--smooth K`` and the study's curves: y_i -> mean(y_max(0, i-K+1) .. y_i), written out by hand."""
    ys = [5.0, 4.0, 6.5, 3.0, 2.5, 2.0]
    if window <= 1:
        want = ys
    else:
        want = [sum(ys[j] for j in range(max(0, i - window + 1), i + 1)) / (i + 1 - max(0, i - window + 1))
                for i in range(len(ys))]
    assert trailing_mean(ys, window) == pytest.approx(want, rel=1e-15)
    assert trailing_mean(ys, 3)[:4] == pytest.approx([5.0, 4.5, 15.5 / 3, 4.5])


def _png(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    return img


def test_depth_points_pick_best_lr(sweep_dir):
    s = load_sweep(sweep_dir)
    pts = depth_points(s)
    assert set(pts) == {"residual=keel", "residual=pre_ln"}
    for scheme in ("keel", "pre_ln"):
        got = pts[f"residual={scheme}"]
        assert [p[0] for p in got] == [2, 4]  # sub-layers
        for L, loss, run in got:
            cands = [r["final_val_loss"] for r in s["runs"] if r["values"]["model.residual"] == scheme
                     and 2 * r["values"]["model.n_layers"] == L and not r["diverged"]]
            assert loss == min(cands) and run["final_val_loss"] == loss


def test_legend_labels_count_sub_layers():
    """The LR plot's lines are labelled by depth in sub-layers (model.n_layers counts blocks)."""
    from keel.experiments.plot import _series_key

    values = {"model.residual": "keel", "model.n_layers": 2, "train.lr": 0.01}
    assert _series_key(values, ["train.lr"]) == "residual=keel, 4 sub-layers"


def test_plots_are_written(sweep_dir, tmp_path, keel_main):
    assert plot_loss_curves([sweep_dir], tmp_path / "loss.png") == 8
    assert plot_loss_curves([sweep_dir / "keel_L2_lr0.001", sweep_dir / "pre_ln_L4_lr0.01"], tmp_path / "v.png",
                            val=True, x="steps") == 2
    assert len(plot_depth(sweep_dir, tmp_path / "depth.png")) == 2
    assert plot_lr(sweep_dir, tmp_path / "lr.png") == 4  # scheme x depth lines
    for f in ("loss.png", "v.png", "depth.png", "lr.png"):
        _png(tmp_path / f)
    r = keel_main("plot", "depth", sweep_dir, "--out", tmp_path / "new" / "cli.png")  # its folder is made
    assert r.returncode == 0 and "2 lines" in r.stdout, r.stderr
    _png(tmp_path / "new" / "cli.png")
    r = keel_main("plot", "loss", tmp_path, "--out", tmp_path / "x.png")
    assert r.returncode == 2 and "not a run folder" in r.stderr


def test_plot_errors(sweep_dir, tmp_path):
    with pytest.raises(KeelError, match="--x"):
        plot_loss_curves([sweep_dir], tmp_path / "a.png", x="time")
    with pytest.raises(KeelError, match="no report.json with a sweep table, no sweep.json"):
        plot_depth(sweep_dir / "keel_L2_lr0.001", tmp_path / "b.png")


def test_plots_read_the_report_not_the_deprecated_alias(sweep_dir, tmp_path):
    """`keel plot` read a sweep's table from sweep.json, the deprecated alias that goes in the next
    release; a folder without it (report.json only) was "not a sweep folder". Now the table is
    report.json's group_tables["sweep"] (the same data as the alias), and a folder written before
    report.json existed still reads its sweep.json."""
    import json
    import shutil

    new = tmp_path / "new"
    shutil.copytree(sweep_dir, new)
    (new / "sweep.json").unlink()
    (new / "sweep.md").unlink()
    assert load_sweep(new) == json.loads((sweep_dir / "sweep.json").read_text())
    assert plot_loss_curves([new], tmp_path / "loss.png") == 8
    assert len(plot_depth(new, tmp_path / "depth.png")) == 2 and plot_lr(new, tmp_path / "lr.png") == 4
    old = tmp_path / "old"
    shutil.copytree(sweep_dir, old)
    (old / "report.json").unlink()
    assert load_sweep(old) == load_sweep(new)
    (old / "report.json").write_text("[1, 2]")  # not a report: one line naming the file
    with pytest.raises(KeelError, match=r"report.json: not a keel report"):
        load_sweep(old)


def test_a_negative_smoothing_window_is_refused_and_one_curve_is_singular(sweep_dir, keel_main, tmp_path):
    """`keel plot loss --smooth -3` drew unsmoothed curves without a word, and one run was "1 curves"."""
    r = keel_main("plot", "loss", sweep_dir / "keel_L2_lr0.001", "--smooth", "-3", "--out", tmp_path / "a.png")
    assert r.returncode == 2 and "--smooth must be >= 0" in r.stderr and not (tmp_path / "a.png").exists()
    r = keel_main("plot", "loss", sweep_dir / "keel_L2_lr0.001", "--smooth", "2", "--out", tmp_path / "a.png")
    assert r.returncode == 0 and r.stdout.strip() == f"{tmp_path / 'a.png'}: 1 curve"


@pytest.mark.parametrize("smooth", ["1", "5"])
def test_smoothing_with_val_is_refused_not_ignored(sweep_dir, keel_main, tmp_path, smooth):
    """`keel plot loss --val --smooth 5` drew the very plot `--val` alone draws (--smooth averages the
    training loss only), without a word."""
    r = keel_main("plot", "loss", sweep_dir / "keel_L2_lr0.001", "--val", "--smooth", smooth, "--out", tmp_path / "a.png")
    assert (r.returncode, r.stderr) == (2, "keel: error: --smooth averages the training loss; --val plots the "
                                           "validation loss unsmoothed: drop one\n")
    assert not (tmp_path / "a.png").exists()


@pytest.mark.parametrize("kind", ["depth", "lr"])
def test_flags_of_loss_curves_are_refused_for_depth_and_lr(sweep_dir, keel_main, tmp_path, kind):
    """`keel plot depth --val --smooth 5 --x steps` drew the same plot as without them, without a word."""
    r = keel_main("plot", kind, sweep_dir, "--val", "--smooth", "5", "--x", "steps", "--out", tmp_path / "a.png")
    assert r.returncode == 2 and not (tmp_path / "a.png").exists()
    assert r.stderr.strip() == (f"keel: error: --val, --x, --smooth: only `keel plot loss` reads them; `keel plot {kind}` "
                                "plots each run's final validation loss")


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"), (".pdf", b"%PDF"), (".jpg", b"\xff\xd8\xff"),
                                           ("", b"\x89PNG")])
def test_the_out_suffix_picks_the_image_format(sweep_dir, tmp_path, suffix, magic):
    """`--out x.jpg` wrote PNG bytes into x.jpg."""
    out = tmp_path / f"depth{suffix}"
    plot_depth(sweep_dir, out)
    assert out.read_bytes().startswith(magic) and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_an_image_format_matplotlib_cannot_write_is_one_line(sweep_dir, keel_main, tmp_path):
    r = keel_main("plot", "depth", sweep_dir, "--out", tmp_path / "depth.docx")
    assert r.returncode == 2 and not list(tmp_path.iterdir())
    assert r.stderr.startswith(f"keel: error: cannot write {tmp_path / 'depth.docx'}: matplotlib writes no .docx files; "
                               "give --out one of ") and len(r.stderr.strip().splitlines()) == 1
    assert {".pdf", ".png", ".svg"} <= set(r.stderr.strip().split("give --out one of ")[1].split(", "))


def test_gradflow_refuses_a_plot_it_cannot_write_before_it_profiles(keel_main, tmp_path):
    """`keel gradflow --plot x.txt` profiled first, printed the table, then said "give --out one of ..."."""
    r = keel_main("gradflow", "--residual", "keel", "--sublayers", "2", "--plot", tmp_path / "x.txt")
    assert r.returncode == 2 and r.stdout == "" and not list(tmp_path.iterdir())
    assert r.stderr.startswith(f"keel: error: cannot write {tmp_path / 'x.txt'}: matplotlib writes no .txt files; "
                               "give --plot one of ")


def test_plots_read_a_study_grid_group(tiny_data, tmp_path, keel_main):
    """`keel plot depth OUT` of a `keel study` whose grid group has its sweep table in OUT/report.json was
    "not a sweep folder (no report.json with a sweep table ...)", and so was the group's own folder OUT/GROUP.
    Now either draws the group's table (its runs under OUT/GROUP); a study of several grid groups names them."""
    study = tmp_path / "s.toml"
    study.write_text('[groups.g]\nkind = "grid"\nbest_over = "train.lr"\n[groups.g.grid]\n'
                     '"train.lr" = [1e-3, 1e-2]\n"model.n_layers" = [1, 2]\n')
    sets = tiny_overrides(tiny_data, ("model.n_layers", "train.lr"), steps=2, eval_every=2, checkpoint_every=4)
    out = tmp_path / "o"
    r = keel_main("study", study, "--out", out, "--workers", 0, *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stderr
    for folder in (out, out / "g"):
        assert len(plot_depth(folder, tmp_path / "depth.png")) == 1
        assert plot_lr(folder, tmp_path / "lr.png") == 2 and plot_loss_curves([folder], tmp_path / "loss.png") == 4
    study.write_text(study.read_text() + study.read_text().replace("groups.g", "groups.h"))
    two = tmp_path / "two"
    r = keel_main("study", study, "--out", two, "--workers", 0, *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stderr
    with pytest.raises(KeelError, match=f"several grid groups: give one's folder \\({two / 'g'}, {two / 'h'}\\)"):
        plot_depth(two, tmp_path / "depth.png")
    assert len(plot_depth(two / "h", tmp_path / "depth.png")) == 1


@pytest.mark.parametrize("kind", ["sweep", "sensitivity"])
def test_an_lr_plot_with_no_finished_run_is_refused(sweep_dir, tmp_path, kind):
    """`keel plot lr` on a sweep (or lr-sensitivity folder) with no finished run wrote an empty plot
    and exited 0; now one line says there is nothing to plot, and no file is written."""
    import json
    import shutil

    from keel.cli import main

    folder = tmp_path / "f"
    if kind == "sweep":
        shutil.copytree(sweep_dir, folder)
        rep = json.loads((folder / "report.json").read_text())
        for r in rep["group_tables"]["sweep"]["runs"]:
            r["status"] = "error"
        (folder / "report.json").write_text(json.dumps(rep))
        (folder / "sweep.json").write_text(json.dumps(rep["group_tables"]["sweep"]))
    else:
        folder.mkdir()
        cell = {"sublayers": 4, "scheme": "keel", "n_seeds": 0, "seeds": {}, "mean_curve": [], "init_loss": 6.2}
        summary = {"sublayers": [4], "schemes": ["keel"], "lrs": [1e-3, 3e-3], "unigram_entropy": 5.0, "cells": [cell]}
        (folder / "report.json").write_text(json.dumps({"group_tables": {"sensitivity": summary}}))
    with pytest.raises(KeelError, match="no finished runs in"):
        plot_lr(folder, tmp_path / "lr.png")
    assert main(["plot", "lr", str(folder), "--out", str(tmp_path / "lr.png")]) == 2
    assert not (tmp_path / "lr.png").exists()


def test_a_looped_sweep_counts_its_effective_sub_layers(tiny_data, tmp_path):
    """A sweep over model.n_layers of a looped model (P, C, R = 1, 1, 3: 2 (1 + 3 + Q) sub-layers, Q = 1, 2)
    named its runs, labelled its report and drew its depth axis at 2 x n_layers (L6 and L8: the blocks of
    weights) instead of the effective depth (10 and 12) that its dry run and report.json give."""
    out = tmp_path / "sw"
    grid = parse_grid(["model.n_layers=3,4", "train.lr=1e-3,1e-2"])
    sets = tiny_overrides(tiny_data, ("model.n_layers", "train.lr"), steps=2, eval_every=2, checkpoint_every=2)
    sets += ["model.loop_prelude=1", "model.loop_core=1", "model.loop_repeats=3"]
    s = run_sweep(str(REPO / "keel" / "configs" / "demo.toml"), grid, sets, out=out, workers=0, best="train.lr")
    assert [r["name"] for r in s["runs"]] == ["L10_lr0.001", "L10_lr0.01", "L12_lr0.001", "L12_lr0.01"]
    assert [r["sublayers"] for r in s["runs"]] == [10, 10, 12, 12]
    md = (out / "report.md").read_text()
    depth_cells = [line.split(" |")[0] for line in md.splitlines() if line.startswith(("| 3 (", "| 4 ("))]
    assert depth_cells == ["| 3 (10)"] * 2 + ["| 4 (12)"] * 2 + ["| 3 (10)", "| 4 (12)"]  # the runs; the best LR
    assert [p[0] for p in plot_depth(out, tmp_path / "d.png")["runs"]] == [10, 12]  # the x axis of keel plot depth
    _png(tmp_path / "d.png")
