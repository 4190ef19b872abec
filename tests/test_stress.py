"""keel stress: the max-LR stress test grid, end to end on a tiny model."""

import json
import math

import pytest
from conftest import assert_report_section, tiny_overrides

from keel import KeelError
from keel.cli import main
from keel.data.stats import dataset_unigram_entropy
from keel.diagnostics.divergence import MODES, classify_metrics
from keel.experiments.presets import SENSITIVITY_OWNED, STRESS_OWNED, run_stress
from keel.experiments.stress import (
    REFERENCES,
    max_lr,
    stress_table,
    table_markdown,
)
from keel.rundir import RunDir

SCHEMES = ["pre_ln", "post_ln"]
RAMP, PEAK = 30, 5.0


def grid(tiny_data, out, workers=1, **kw):
    sets = tiny_overrides(tiny_data, STRESS_OWNED, eval_every=1000, checkpoint_every=10)
    args = dict(config="demo", overrides=sets, schemes=SCHEMES, sublayers=[4], seeds=[0], peak_lr=PEAK,
                ramp_steps=RAMP, out=out, workers=workers, threads=1)
    args.update(kw)
    return run_stress(**args)


def metrics(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_worker(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("stress1")
    return out, grid(tiny_data, out)


def test_grid_end_to_end(one_worker, tiny_data):
    out, res = one_worker
    assert sorted(res["trained"]) == ["post_ln-4sl-seed0", "pre_ln-4sl-seed0"] and res["cached"] == []
    for f in ("stress.json", "stress.md", "stress.png"):
        assert (out / f).stat().st_size > 100
    saved = json.loads((out / "stress.json").read_text())
    assert saved["table"] == res["table"] and len(saved["runs"]) == 2
    # one reference run per (depth, seed): Pre-LN on the same ramp, not stopped on divergence
    ref_dir = (out / REFERENCES / "pre_ln-4sl-seed0").resolve()
    assert [r["name"] for r in res["references"]] == ["pre_ln-4sl-seed0"] and res["references"][0]["stopped"] is None
    assert max(q["step"] for q in metrics(ref_dir)) == RAMP
    h1 = dataset_unigram_entropy(tiny_data)
    for r in res["runs"]:
        recs = metrics(out / r["name"])
        # every result names its reference and is judged against it (one verdict vocabulary)
        assert r["reference"] == str(ref_dir) and r["verdict"] in MODES and r["unigram_entropy"] == pytest.approx(h1)
        assert r["divergence"] == classify_metrics(recs, metrics(ref_dir), unigram_entropy=h1).to_dict()
        # the LR ramp: step k (1-based) runs at peak * k / ramp (lr_at with warmup = steps = ramp)
        for q in recs:
            if "lr" in q:
                assert q["lr"] == pytest.approx(PEAK * q["step"] / RAMP)
        # an LR of 5 blows the tiny model up before the end of the ramp
        assert r["diverged"] and r["verdict"] == "instability"
        # max LR = the LR logged at the step before the verdict step
        k = r["divergence"]["step"]
        assert r["max_lr"] == pytest.approx(next(q["lr"] for q in recs if q["step"] == k - 1))
        assert r["max_lr"] == pytest.approx(PEAK * (k - 1) / RAMP)
        assert (r["sublayers"], r["blocks"]) == (4, 2)


def test_the_table_is_a_section_of_the_one_report(one_worker):
    """keel stress writes the engine's one report: its table is a section of report.md and its data
    report.json's group_tables["stress"]; stress.md / stress.json are deprecated aliases of them."""
    out, res = one_worker
    assert_report_section(out, "stress", "stress")
    assert json.loads((out / "report.json").read_text())["group_tables"]["stress"]["table"] == res["table"]
    assert "## Group stress: stress test, max LR per scheme and depth" in (out / "report.md").read_text()


def test_two_workers_match_one(tiny_data, tmp_path, one_worker):
    _, res1 = one_worker
    res2 = grid(tiny_data, tmp_path, workers=2)
    assert sorted(res2["trained"]) == sorted(res1["trained"])
    for a, b in zip(res1["runs"], res2["runs"]):
        assert (a["name"], a["divergence"], a["max_lr"]) == (b["name"], b["divergence"], b["max_lr"])
        assert metrics(tmp_path / a["name"])[-1]["loss"] == pytest.approx(metrics(one_worker[0] / a["name"])[-1]["loss"])


def test_cli_json_on_cached_grid(one_worker, tiny_data, capsys):
    out, res = one_worker
    sets = sum((["--set", s] for s in tiny_overrides(tiny_data, STRESS_OWNED, eval_every=1000, checkpoint_every=10)), [])
    rc = main(["stress", "--residual", ",".join(SCHEMES), "--sublayers", "4", "--seeds", "0", "--peak-lr", str(PEAK),
               "--ramp-steps", str(RAMP), "--out", str(out), "--json", "--resume", *sets])
    assert rc == 0
    table = json.loads(capsys.readouterr().out)
    assert table == json.loads(json.dumps(res["table"]))
    assert all(math.isfinite(c["median"]) for c in table["rows"][0]["cells"].values())


def test_cached_runs_are_skipped_and_interrupted_ones_resumed(tiny_data, one_worker):
    out, res1 = one_worker
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")}
    with pytest.raises(KeelError, match="--resume"):
        grid(tiny_data, out)
    res = grid(tiny_data, out, resume=True)
    assert res["trained"] == [] and sorted(res["cached"]) == sorted(res1["trained"])
    assert {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")} == mtimes
    assert res["table"] == res1["table"]
    # the same --out with other settings is refused, not mixed up
    with pytest.raises(KeelError, match=r"other settings \(train.lr, train.steps, train.warmup_steps\)"):
        grid(tiny_data, out, ramp_steps=RAMP + 1, peak_lr=PEAK / 2, resume=True)
    # an interrupted run (no result file) is resumed, the other stays cached
    (out / "pre_ln-4sl-seed0" / RunDir.RESULT).unlink()
    res = grid(tiny_data, out, resume=True)
    assert res["trained"] == ["pre_ln-4sl-seed0"] and res["cached"] == ["post_ln-4sl-seed0"]
    assert [r["divergence"] for r in res["runs"]] == [r["divergence"] for r in res1["runs"]]
    # report-only tabulates finished runs and trains nothing
    (out / "post_ln-4sl-seed0" / RunDir.RESULT).unlink()
    res = grid(tiny_data, out, report_only=True)
    assert res["trained"] == [] and [r["name"] for r in res["runs"]] == ["pre_ln-4sl-seed0"]
    assert res["table"]["rows"][0]["cells"]["post_ln"]["text"] == "–"
    # report-only with another ramp than the runs had: refused, stress.json untouched (was written with the new flags)
    before = (out / "stress.json").read_text()
    with pytest.raises(KeelError, match=r"other settings \(train.lr, train.steps, train.warmup_steps\)"):
        grid(tiny_data, out, ramp_steps=RAMP + 1, peak_lr=PEAK / 2, report_only=True)
    assert (out / "stress.json").read_text() == before
    # report-only where no run has finished: refused, nothing written (was an empty report)
    empty = out.parent / "no-runs"
    with pytest.raises(KeelError, match="holds no finished run: nothing to report"):
        grid(tiny_data, empty, report_only=True)
    assert not empty.exists()
    other = out.parent / "other-grid" / "some-run"  # a folder with a finished run, none of this grid's
    other.mkdir(parents=True)
    (other / RunDir.RESULT).write_text("{}")
    with pytest.raises(KeelError, match="no finished run of this stress test: nothing to report; check --out and"):
        grid(tiny_data, other.parent, report_only=True)
    # other schemes than the folder's runs: the message gives the command that started it
    marker = json.loads((out / "study.json").read_text())
    (out / "study.json").write_text(json.dumps({**marker, "command": "keel stress --residual pre_ln,post_ln"}))
    with pytest.raises(KeelError, match=r"no finished run of this stress test: nothing to report; its runs are of "
                                        r"`keel stress --residual pre_ln,post_ln`: give those grid flags$"):
        grid(tiny_data, out, schemes=["keel"], report_only=True)
    (out / "study.json").write_text(json.dumps(marker))


def _r(scheme, L, lr):
    return {"scheme": scheme, "sublayers": L, "diverged": lr is not None, "max_lr": lr}


def test_table_format():
    results = [_r("pre_ln", 64, 1e-3), _r("pre_ln", 64, 3e-3), _r("pre_ln", 64, 2e-3),
               _r("keel", 64, None), _r("keel", 64, None), _r("keel", 64, None),
               _r("pre_ln", 256, 1e-3), _r("pre_ln", 256, None), _r("pre_ln", 256, None),
               _r("keel", 256, 4e-3), _r("keel", 256, None)]
    t = stress_table(results, ["pre_ln", "keel"], [64, 256])
    assert t["columns"] == ["pre_ln", "keel"] and [r["sublayers"] for r in t["rows"]] == [64, 256]
    c = t["rows"][0]["cells"]
    assert (c["pre_ln"]["median"], c["pre_ln"]["min"], c["pre_ln"]["max"]) == (2e-3, 1e-3, 3e-3)
    assert c["pre_ln"]["text"] == "2.00e-03 (1.00e-03–3.00e-03)"
    assert c["keel"]["text"] == "no div." and c["keel"]["n"] == 3 and c["keel"]["n_diverged"] == 0
    c = t["rows"][1]["cells"]
    # a run that did not diverge counts as +inf: median of (1e-3, inf, inf) is inf
    assert c["pre_ln"]["median"] is None and c["pre_ln"]["text"] == "no div. (1.00e-03–no div.), 2/3 no div."
    # even count: mean of the two middle values (4e-3, inf) = inf
    assert c["keel"]["text"] == "no div. (4.00e-03–no div.), 1/2 no div."
    md = table_markdown(t, 5e-2).splitlines()
    assert md[0] == "| depth: sub-layers (blocks) | pre_ln | keel |"
    assert md[2] == "| 64 (32 blocks) | 2.00e-03 (1.00e-03–3.00e-03) | no div. |"
    assert md[3].startswith("| 256 (128 blocks) | no div. (1.00e-03–no div.)")
    assert "peak LR 0.05" in md[-1]
    one = stress_table([_r("keel", 8, 2.5e-2)], ["keel"], [8])
    assert one["rows"][0]["cells"]["keel"]["text"] == "2.50e-02"
    two = table_markdown(stress_table([_r("keel", 2, 2.5e-2)], ["keel"], [2])).splitlines()
    assert two[2] == "| 2 (1 block) | 2.50e-02 |"  # was "(1 blocks)"


def test_max_lr_transcription():
    recs = [{"step": 0, "val_loss": 7.0}] + [{"step": k, "loss": 1.0, "lr": 0.1 * k} for k in range(1, 11)]
    for k in range(2, 11):
        assert max_lr(recs, k) == pytest.approx(0.1 * (k - 1))
    assert max_lr(recs, 1) == 0.0
    with pytest.raises(KeelError):
        max_lr(recs, 20)


@pytest.mark.parametrize("args,msg", [
    (["--sublayers", "63"], "must be even"),
    (["--sublayers", "64,x"], "--sublayers must be a comma-separated list"),
    (["--residual", "pre_ln,nope"], "--residual: unknown scheme 'nope'"),
    (["--reference-scheme", "preln"], "--reference-scheme: unknown scheme 'preln'"),
    (["--peak-lr", "0"], "--peak-lr must be > 0"),
    (["--ramp-steps", "1"], "--ramp-steps must be >= 2"),
    (["--seeds", "0,0"], "must not repeat"),
])
def test_bad_input_one_line_errors(args, msg, capsys, tmp_path):
    assert main(["stress", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("keel: error: ") and msg in err and err.count("\n") == 1


@pytest.mark.parametrize("command", ["stress", "lr-sensitivity"])
def test_report_only_on_a_study_folder_names_the_study(command, keel_main, tiny_data, tmp_path):
    """`keel stress --out STUDY --report-only` on a `keel study` folder (its runs in its groups' folders) said
    only "holds no finished run: nothing to report; check --out", though the folder holds a study's finished
    runs; now the line names the command the folder is of."""
    study = tmp_path / "s.toml"
    study.write_text('[groups.g]\nschemes = ["keel"]\nsublayers = [2]\nseeds = [0]\nlrs = [1e-3]\n')
    sets = [a for s in tiny_overrides(tiny_data, ("model.n_layers", "train.lr", "train.seed"), steps=2,
                                      eval_every=2, sample_tokens=0) for a in ("--set", s)]
    out = tmp_path / "o"
    assert keel_main("study", study, "--out", out, "--workers", 0, *sets).returncode == 0
    r = keel_main(command, "--out", out, "--report-only")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "holds no finished run of this" in r.stderr and f"it is the folder of `keel study {study}" in r.stderr


@pytest.mark.parametrize("command", ["stress", "lr-sensitivity"])
def test_resume_or_report_only_alone_continues_the_grid_its_folder_holds(command, keel_main, tiny_data, tmp_path):
    """`keel stress --out DIR --resume` alone took the defaults (every scheme, 64 sub-layers, seeds
    0,1,2, the demo corpus) and trained that other grid into DIR; `--report-only` alone refused. Both
    now take the grid flags and --set flags DIR was started with; a grid flag given is kept (a report of
    another grid, of no finished run, is refused)."""
    owned, grid_flags = {"stress": (STRESS_OWNED, ["--peak-lr", "1e-3", "--ramp-steps", "3"]),
                         "lr-sensitivity": (SENSITIVITY_OWNED, ["--lrs", "1e-3"])}[command]
    sets = [a for s in tiny_overrides(tiny_data, owned, steps=3, eval_every=3, sample_tokens=0) for a in ("--set", s)]
    out = tmp_path / "o"
    first = ["--residual", "keel", "--sublayers", "2", "--seeds", "0", *grid_flags]
    assert keel_main(command, *first, *sets, "--workers", 0, "--threads", 1, "--out", out).returncode == 0
    folders = sorted(p.name for p in out.rglob("*") if p.is_dir())
    for flag in ("--report-only", "--resume"):  # --report-only first: before the fix it refused (fast)
        r = keel_main(command, "--out", out, flag, "--json")
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in out.rglob("*") if p.is_dir()) == folders  # no run of another grid
    r = keel_main(command, "--out", out, "--report-only", "--seeds", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "holds no finished run of this" in r.stderr, r.stderr
    if command == "stress":  # another ramp is no subset of the grid: refused by its flag (it named train.lr)
        for flag, value in (("--peak-lr", "2e-3"), ("--ramp-steps", "4")):
            r = keel_main(command, "--out", out, "--resume", flag, value)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
            assert f"--resume continues the stress {out} holds" in r.stderr and f"{flag} differs" in r.stderr
