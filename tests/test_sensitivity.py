"""keel lr-sensitivity: the Wortsman et al. 2023 formula, the tables, and a tiny grid end to end."""

import json
import math

import numpy as np
import pytest

from keel.experiments.record import RunRecord
from conftest import REPO, assert_report_section, tiny_overrides

from keel.data.stats import dataset_unigram_entropy, unigram_entropy
from keel.errors import KeelError
from keel.experiments.presets import SENSITIVITY_OWNED
from keel.experiments.sensitivity import cell_summary, lr_sensitivity, seed_curve

DEMO = str(REPO / "keel" / "configs" / "demo.toml")


def test_lr_sensitivity_transcription():
    # arXiv 2309.14322 Sec. 3.2: E_eta[min(l(eta), l0) - min_eta l(eta)]; diverged runs count as l0
    losses, l0 = [5.0, 4.0, 4.5, None, 9.0], 6.0
    capped = [5.0, 4.0, 4.5, 6.0, 6.0]
    expected = sum(c - min(capped) for c in capped) / len(capped)
    assert lr_sensitivity(losses, l0) == pytest.approx(expected) == pytest.approx(1.1)
    assert lr_sensitivity([3.0, float("nan")], 3.5) == pytest.approx(0.25)
    assert lr_sensitivity([2.0], 3.0) == 0.0
    with pytest.raises(KeelError):
        lr_sensitivity([], 3.0)
    with pytest.raises(KeelError):
        lr_sensitivity([1.0], float("nan"))


def _run(seed, lr, final, first=6.0, status="done"):
    return RunRecord(seed=seed, lr=lr, status=status, final_val_loss=final, first_val_loss=first)


def test_seed_curve_and_cell_summary():
    lrs = [1e-3, 1e-2, 1e-1]
    a = seed_curve([_run(0, 1e-3, 5.0), _run(0, 1e-2, 4.0), _run(0, 1e-1, None)], lrs)
    b = seed_curve([_run(1, 1e-3, 4.8), _run(1, 1e-2, 4.2), _run(1, 1e-1, 7.0)], lrs)
    assert a["opt_lr"] == 1e-2 and a["best_loss"] == 4.0 and a["capped"] == [5.0, 4.0, 6.0]
    assert a["sensitivity"] == pytest.approx((1.0 + 0 + 2.0) / 3)
    assert seed_curve([_run(0, 1e-3, 5.0)], lrs) is None  # incomplete curve
    c = cell_summary([a, b], lrs)
    assert c["n_seeds"] == 2 and c["opt_lr"] == 1e-2 and not c["at_edge"]
    assert c["best_loss"] == pytest.approx(4.1) and c["best_loss_sd"] == pytest.approx(math.sqrt(0.02))
    assert c["mean_curve"] == pytest.approx([4.9, 4.1, 6.0])
    edge = seed_curve([_run(0, 1e-3, 3.0), _run(0, 1e-2, 4.0), _run(0, 1e-1, 5.0)], lrs)
    assert cell_summary([edge], lrs)["at_edge"]


def test_unigram_entropy_transcription(tiny_data):
    toks = np.array([0, 0, 1, 2, 2, 2, 2, 3], dtype=np.uint16)
    p = np.array([2, 1, 4, 1]) / 8
    assert unigram_entropy(toks) == pytest.approx(float(-(p * np.log(p)).sum()))
    assert unigram_entropy(np.zeros(5, dtype=np.uint16)) == 0.0
    with pytest.raises(KeelError):
        unigram_entropy(toks, vocab_size=3)
    meta = json.loads((tiny_data / "meta.json").read_text())
    from keel.data.shards import read_shard

    h = unigram_entropy(read_shard(tiny_data / "train.bin"))
    assert 0 < h < math.log(meta["vocab_size"])
    assert meta["unigram_entropy"] == pytest.approx(h)  # stored by keel prepare
    assert dataset_unigram_entropy(tiny_data) == pytest.approx(h)


def test_unigram_entropy_added_to_an_old_dataset(tiny_data, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny_data, old)
    meta = json.loads((old / "meta.json").read_text())
    meta.pop("unigram_entropy", None)
    (old / "meta.json").write_text(json.dumps(meta))
    h = dataset_unigram_entropy(old)
    assert json.loads((old / "meta.json").read_text())["unigram_entropy"] == pytest.approx(h)


@pytest.mark.long
def test_lr_sensitivity_cli_end_to_end(keel_cli, keel_main, tiny_data, tmp_path):
    out = tmp_path / "sens"
    sets = tiny_overrides(tiny_data, SENSITIVITY_OWNED, steps=6, warmup_steps=2, eval_every=6, checkpoint_every=100,
                          sample_tokens=0)
    args = ["lr-sensitivity", "--config", DEMO, "--residual", "pre_ln,keel", "--sublayers", "2,4", "--lrs", "1e-3,1e-2,10",
            "--seeds", "0", "--workers", "0", "--out", out]
    for s in sets:
        args += ["--set", s]
    r = keel_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    saved = json.loads((out / "sensitivity.json").read_text())
    assert shown["cells"] == json.loads(json.dumps(saved["cells"]))
    assert len(saved["runs"]) == 2 * 2 * 3 and all(x["status"] == "done" for x in saved["runs"])
    want = [(2, "pre_ln"), (2, "keel"), (4, "pre_ln"), (4, "keel")]
    assert [(c["sublayers"], c["scheme"]) for c in saved["cells"]] == want
    for cell in saved["cells"]:
        cur = cell["seeds"]["0"]
        assert cell["n_seeds"] == 1 and cell["opt_lr"] in (1e-3, 1e-2, 10.0)
        assert cur["sensitivity"] == pytest.approx(lr_sensitivity(cur["losses"], cur["init_loss"]))
        assert cur["init_loss"] == pytest.approx(math.log(512), abs=0.3)
    assert saved["unigram_entropy"] == pytest.approx(dataset_unigram_entropy(tiny_data))
    assert (out / "sensitivity.png").stat().st_size > 1000 and "LR sensitivity" in (out / "sensitivity.md").read_text()
    assert_report_section(out, "sensitivity", "sensitivity")  # the one report: its table is a section of report.md
    # cached: a resumed run trains nothing; report-only reads the same numbers
    again = keel_main(*args, "--resume")
    assert again.returncode == 0 and "12 finished already, 0 to run" in again.stderr  # progress lines are logged (stderr)
    rep = keel_main(*args, "--report-only")
    assert rep.returncode == 0 and "12/12 runs finished" in rep.stderr
    empty = tmp_path / "no-runs"  # report-only where no run has finished: one line, nothing written
    none = keel_main(*[empty if a == out else a for a in args], "--report-only")
    assert none.returncode == 2 and "nothing to report" in none.stderr and "Traceback" not in none.stderr
    assert not empty.exists()
    bad = keel_main(*args)  # not empty without --resume
    assert bad.returncode == 2 and "--resume" in bad.stderr and "Traceback" not in bad.stderr
    # --resume with a narrower --lrs: the LR-10 runs drop out of the tables, and the command says so
    fewer = keel_main(*[("1e-3,1e-2" if a == "1e-3,1e-2,10" else a) for a in args], "--resume")
    assert fewer.returncode == 0 and "8 finished already, 0 to run" in fewer.stderr, fewer.stderr
    assert (f"lr-sensitivity: {out} holds run folders that are not runs of this grid, left out of its tables: "
            "L2_seed0_keel_lr10, L2_seed0_pre_ln_lr10, L4_seed0_keel_lr10, ... (4 in all)") in fewer.stderr
    assert "not runs of this grid" not in again.stderr


def test_max_lr_below_and_paired_differences():
    from keel.experiments.sensitivity import markdown, max_lr_below, paired_differences

    lrs = [1e-3, 1e-2, 1e-1]
    assert max_lr_below([5.0, 5.2, 6.0], lrs, 5.3) == 1e-2
    assert max_lr_below([5.0, None, 5.1], lrs, 5.3) == 1e-1
    assert max_lr_below([6.0, None, 7.0], lrs, 5.3) is None

    def curve(best, sens):
        return {"best_loss": best, "sensitivity": sens}

    cells = [{"sublayers": 4, "scheme": "pre_ln", "seeds": {0: curve(5.0, 0.4), 1: curve(5.2, 0.5)}},
             {"sublayers": 4, "scheme": "keel", "seeds": {0: curve(4.5, 0.3), 1: curve(4.9, 0.1), 2: curve(1.0, 0.0)}},
             {"sublayers": 8, "scheme": "keel", "seeds": {0: curve(4.0, 0.3)}}]
    summary = {"sublayers": [4, 8], "schemes": ["pre_ln", "keel"], "cells": cells}
    rows = paired_differences(summary, "keel", "pre_ln", "best_loss")
    # only the seeds both have (0 and 1), only the depths both have (4)
    assert [r["sublayers"] for r in rows] == [4] and rows[0]["diffs"] == pytest.approx({0: -0.5, 1: -0.3})
    assert rows[0]["mean"] == pytest.approx(-0.4) and rows[0]["sd"] == pytest.approx(math.sqrt(0.02))
    sens = paired_differences(summary, "keel", "pre_ln", "sensitivity")[0]
    assert sens["diffs"] == pytest.approx({0: -0.1, 1: -0.4})
    lrs = [1e-3, 1e-2]
    full = [dict(c, n_seeds=len(c["seeds"]), opt_lr=1e-2, at_edge=True, seed_opt_lrs=[1e-2] * len(c["seeds"]),
                 seed_max_lr_past_plateau=[None] * len(c["seeds"]), best_loss=1.0, best_loss_sd=0.0, sensitivity=0.1,
                 sensitivity_sd=0.0, init_loss=6.0, init_loss_sd=0.0) for c in cells]
    md = markdown({"lrs": lrs, "unigram_entropy": 5.0, "sublayers": [4, 8], "schemes": ["pre_ln", "keel"], "cells": full})
    assert "| 4 | keel | -0.500, -0.300 | -0.400 | -0.100, -0.400 | -0.250 |" in md
    assert "| keel | 0.01 [0.01, 0.01, 0.01]; none, none, none | 0.01 [0.01]; none |" in md
    assert "0.01 (edge)" in md


def test_a_grid_whose_every_run_failed_names_no_plot(keel_main, tiny_data, tmp_path, monkeypatch):
    """Every run failed: no sensitivity.png is drawn, and the command no longer says it wrote one."""
    from keel.experiments import sweep

    def fail(*args, **kwargs):
        raise RuntimeError("this run fails")

    monkeypatch.setattr(sweep, "train_run", fail)
    out = tmp_path / "sens"
    sets = tiny_overrides(tiny_data, SENSITIVITY_OWNED, steps=2, sample_tokens=0)
    r = keel_main("lr-sensitivity", "--config", DEMO, "--residual", "keel", "--sublayers", "2", "--lrs", "1e-3",
                  "--seeds", "0", "--workers", "0", "--out", out, *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 1 and "this run fails" in r.stderr, r.stderr
    assert (out / "sensitivity.json").is_file() and not (out / "sensitivity.png").exists()
    wrote = [ln for ln in r.stdout.splitlines() if ln.startswith("wrote ")]
    assert wrote == [f"wrote {out / 'report.md'}, report.json (sensitivity.md, sensitivity.json: deprecated, see report.md)"]


def test_report_only_of_another_lr_grid_is_refused_and_writes_nothing(keel_main, tiny_data, tmp_path):
    """`keel lr-sensitivity --out DIR --report-only` with grid flags other than DIR's rewrote DIR/report.json for a
    grid of no finished run, then stopped with a traceback (TypeError) formatting its table. As `keel stress`:
    one line naming the command the runs are of, and nothing written. With no grid flag it reports DIR's grid
    (the flags DIR was started with: the defaults' grid was what it refused)."""
    out = tmp_path / "sens"
    sets = [a for s in tiny_overrides(tiny_data, SENSITIVITY_OWNED, steps=2, warmup_steps=1, eval_every=2,
                                      checkpoint_every=100, sample_tokens=0) for a in ("--set", s)]
    grid = ["--residual", "keel", "--sublayers", "2", "--lrs", "1e-3", "--seeds", "0"]
    assert keel_main("lr-sensitivity", "--config", DEMO, *grid, "--workers", "0", "--out", out, *sets).returncode == 0
    before = (out / "report.json").read_bytes()
    alone = keel_main("lr-sensitivity", "--out", out, "--report-only")
    assert alone.returncode == 0 and "1/1 runs finished" in alone.stderr, alone.stderr
    before = (out / "report.json").read_bytes()
    r = keel_main("lr-sensitivity", "--out", out, "--report-only", "--lrs", "3e-3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "holds no finished run of this LR grid" in r.stderr and "--lrs 1e-3" in r.stderr
    assert (out / "report.json").read_bytes() == before
