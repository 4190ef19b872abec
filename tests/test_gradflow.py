"""Gradient-flow profile (keel.diagnostics.gradflow): per-sub-layer gradient norms against
direct computations, J* against closed forms and full Jacobians, depth behaviour at init,
the trainer's logging, and the ``keel gradflow`` command."""

import argparse
import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import REPO
from keel import ModelConfig, Transformer
from keel.cli import build_parser, main
from keel.config import load_config
from keel.data import TokenLoader, find_data, validation_tokens
from keel.errors import KeelError
from keel.model.model import linear_cross_entropy
from keel.diagnostics import gradflow
from keel.diagnostics.gradflow import jacobian_spectral_norms, profile_model, sublayer_grad_norms
from keel.model import SCHEMES, RMSNorm
from keel.experiments.training import train_run
from keel.train.checkpoint import CheckpointManager

ALL = sorted(SCHEMES)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def cfg_for(scheme, n_layers=2, d_model=32, init_std=0.02, vocab=512, **kw):
    return ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=2, n_kv_heads=1,
                       d_ff=3 * d_model, max_seq_len=64, residual=scheme, init_std=init_std, **kw)


@pytest.fixture(scope="module")
def val_batch(tiny_data):
    return validation_tokens(tiny_data, 32, 4 * 32)[:4]


def rmsnorm_ref(x, g, eps):
    """RMSNorm(x) = x / sqrt(mean_i x_i^2 + eps) * g   (Zhang & Sennrich 2019, Eq. 4)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


# ---- per-sub-layer gradient norms ---------------------------------------------------------

@pytest.mark.parametrize("scheme", ALL)
def test_sublayer_grad_norms_match_direct_sum(scheme, val_batch):
    torch.manual_seed(0)
    model = Transformer(cfg_for(scheme, n_layers=3))
    model(val_batch[:, :-1], val_batch[:, 1:]).backward()
    got = sublayer_grad_norms(model)
    assert len(got) == 6
    # transcription: sub-layer 2b = blocks.b.{attn, attn_residual}, 2b+1 = blocks.b.{ffn, ffn_residual}
    expected = [0.0] * 6
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] != "blocks":
            continue
        i = 2 * int(parts[1]) + (0 if parts[2] in ("attn", "attn_residual") else 1)
        expected[i] += float((p.grad.double() ** 2).sum())
    assert got == pytest.approx([math.sqrt(v) for v in expected], rel=1e-12)
    assert all(v > 0 for v in got)


@pytest.mark.parametrize("scheme", ["post_ln", "keel", "hybridnorm", "mix_ln"])
def test_stream_grad_norms_match_retain_grad(scheme, val_batch):
    """The hook-recorded residual-stream gradients equal an explicit forward with retain_grad."""
    torch.manual_seed(0)
    model = Transformer(cfg_for(scheme, n_layers=3, mix_ln_ratio=0.34))
    prof = profile_model(model, val_batch, jacobian_iters=5)
    model.zero_grad(set_to_none=True)
    ids, targets = val_batch[:, :-1], val_batch[:, 1:]
    T = ids.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.tok_emb(ids)
    outs = []
    for blk in model.blocks:
        x = blk.attn_residual(x, lambda h, blk=blk: blk.attn(h, cos, sin))
        x.retain_grad()
        outs.append(x)
        x = blk.ffn_residual(x, blk.ffn)
        x.retain_grad()
        outs.append(x)
    if model.norm is not None:
        x = model.norm(x)
    loss = linear_cross_entropy(x.flatten(0, 1), model.lm_head.weight, targets.reshape(-1))  # as Transformer.forward
    loss.backward()
    assert prof["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert prof["stream_grad_norm"] == pytest.approx([float(o.grad.norm()) for o in outs], rel=1e-5)
    assert prof["param_grad_norm"] == pytest.approx(sublayer_grad_norms(model), rel=1e-12)


# ---- J*: the residual-path Jacobian ---------------------------------------------------------

def test_rmsnorm_jacobian_closed_form():
    """Gain 1: J = (I - y y^T / (d r^2)) / r with r = sqrt(mean(y^2) + eps); its spectral norm is 1/r."""
    norm = RMSNorm(16, eps=1e-5).double()
    y = torch.randn(3, 5, 16, dtype=torch.float64) * torch.tensor([0.02, 1.0, 30.0], dtype=torch.float64)[:, None, None]
    sigma = jacobian_spectral_norms(norm, y, iters=50)
    r = torch.sqrt((y * y).mean(-1) + 1e-5)
    torch.testing.assert_close(sigma, 1 / r, rtol=1e-9, atol=0)


@pytest.mark.parametrize("scheme,index,alpha", [("post_ln", 3, None), ("keel", 3, 5.0), ("keel", 0, None),
                                                 ("deepnorm", 2, None), ("hybridnorm", 1, None),
                                                 ("hybridnorm", 2, None), ("pre_ln", 1, None), ("mix_ln", 0, None)])
def test_shortcut_jacobian_matches_autograd_jacobian(scheme, index, alpha):
    """J* per token = ||d unit(x, F_fixed) / dx||_2, against torch.autograd.functional.jacobian."""
    cfg = cfg_for(scheme, n_layers=4, d_model=16, alpha=alpha, mix_ln_ratio=0.5)
    unit = SCHEMES[scheme](cfg, index).double()
    gen = torch.Generator().manual_seed(index)
    with torch.no_grad():
        for m in unit.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen, dtype=torch.float64) + 0.5)
    x = torch.randn(2, 3, 16, dtype=torch.float64, generator=gen)
    f_fixed = torch.randn(2, 3, 16, dtype=torch.float64, generator=gen) * 0.7
    shortcut = lambda z: unit(z, lambda _h: f_fixed)  # noqa: E731
    sigma = jacobian_spectral_norms(shortcut, x, iters=12)  # 12 < d = 16: a Krylov subspace, not the whole space
    for b in range(2):
        for t in range(3):
            def one_token(v, b=b, t=t):
                z = x.clone()
                z[b, t] = v
                return shortcut(z)[b, t]
            J = torch.autograd.functional.jacobian(one_token, x[b, t])
            exact = torch.linalg.matrix_norm(J, ord=2).item()
            assert sigma[b, t].item() == pytest.approx(exact, rel=2e-5)  # power iteration: 1e-2 here
            assert sigma[b, t].item() <= exact * (1 + 1e-12)  # a Ritz value: never above
    if scheme == "post_ln":  # the paper's J* for Post-LN: ||J_Norm(x + F)||
        y = x + f_fixed
        J0 = torch.autograd.functional.jacobian(lambda v: rmsnorm_ref(v, unit.norm.weight, cfg.norm_eps), y[0, 0])
        assert sigma[0, 0].item() == pytest.approx(torch.linalg.matrix_norm(J0, ord=2).item(), rel=1e-6)


def test_full_jacobian_matches_autograd_on_one_sequence(val_batch):
    """--full-jacobian: per-sequence spectral norm of d unit(x, F) / dx (attention couples tokens)."""
    torch.manual_seed(0)
    model = Transformer(cfg_for("post_ln", n_layers=1, d_model=16))
    batch = val_batch[:1, :7]
    prof = profile_model(model, batch, jacobian_iters=40, full_jacobian=True)  # Krylov dim 40 of 96
    blk = model.blocks[0]
    cos, sin = model.rope_cos[:6], model.rope_sin[:6]
    x0 = model.tok_emb(batch[:, :-1]).detach()
    fn = lambda z: blk.attn_residual(z.view(1, 6, 16), lambda h: blk.attn(h, cos, sin)).reshape(-1)  # noqa: E731
    J = torch.autograd.functional.jacobian(fn, x0.reshape(-1))
    assert prof["full_jacobian"][0] == pytest.approx(torch.linalg.matrix_norm(J, ord=2).item(), rel=1e-5)


@pytest.mark.parametrize("n_layers", [1, 2])
def test_stream_ratio_after_sub_layer_2_needs_a_sub_layer_2(n_layers, val_batch):
    """One block (sub-layers 0 and 1) has no sub-layer 2: "stream 2/L-1" showed s[1] / s[1] = 1.000."""
    torch.manual_seed(0)
    prof = profile_model(Transformer(cfg_for("pre_ln", n_layers=n_layers)), val_batch[:2, :9], jacobian_iters=2)
    s = prof["stream_grad_norm"]
    assert prof["stream_ratio_block1_last"] == (None if n_layers == 1 else pytest.approx(s[2] / s[-1]))
    assert prof["stream_ratio_first_last"] == pytest.approx(s[0] / s[-1])


def test_depth_behaviour_at_xavier_like_init(val_batch):
    """With N(0, 1/d) weights (F about as large as x, the paper's assumption) the Post-LN
    shortcut product decays with depth like c^L, c ~ 1/sqrt(2), while Keel's stays ~1; Keel's
    residual-stream gradient is flat across depth, Post-LN's is not."""
    res = {}
    for scheme in ("post_ln", "keel"):
        for n_layers in (4, 16):
            torch.manual_seed(0)
            model = Transformer(cfg_for(scheme, n_layers=n_layers, init_std=32 ** -0.5))
            res[scheme, n_layers] = profile_model(model, val_batch, jacobian_iters=20)
    post4 = res["post_ln", 4]["log10_jacobian_product_from_block1"]
    post16 = res["post_ln", 16]["log10_jacobian_product_from_block1"]
    per_sublayer = 10 ** (post16 / 30)  # 30 sub-layers from block 1 on
    assert 0.55 < per_sublayer < 0.9
    assert post16 < 3 * post4 < 0  # exponential in depth
    for n_layers in (4, 16):
        assert abs(res["keel", n_layers]["log10_jacobian_product_from_block1"]) < 0.05
    keel_stream = res["keel", 16]["stream_grad_norm"][2:]
    post_stream = res["post_ln", 16]["stream_grad_norm"][2:]
    assert max(keel_stream) / min(keel_stream) < 1.2
    assert max(post_stream) / min(post_stream) > 10


# ---- the trainer logs sublayer_grad_norm ---------------------------------------------------

@pytest.fixture(scope="module")
def gradflow_run(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("gf") / "run"
    cfg = load_config(REPO / "keel" / "configs" / "demo.toml",
                      [f"data.path={tiny_data}", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                       "model.n_kv_heads=1", "model.d_ff=64", "model.max_seq_len=64", "model.vocab_size=512",
                       "train.steps=4", "train.lr=3e-3", "train.warmup_steps=2", "train.batch_size=4",
                       "train.seq_len=32", "train.eval_every=4", "train.eval_tokens=256", "train.checkpoint_every=3",
                       "train.keep_checkpoints=5", "train.progress=false", "train.sample_tokens=4",
                       "train.gradflow_every=2"])
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    train_run(cfg, run)
    torch.set_num_threads(n)
    return run, cfg


def test_trainer_logs_sublayer_grad_norms(gradflow_run, tiny_data):
    run, cfg = gradflow_run
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["sublayer_grad_norm"] for r in recs if "sublayer_grad_norm" in r}
    assert sorted(logged) == [2, 4]
    for v in logged.values():
        assert len(v) == cfg.model.n_sublayers == 4
        assert all(math.isfinite(x) and x > 0 for x in v)
    # Reproduce step 4's entry: the weights after step 3 (checkpoint) and the 4th training batch.
    ckpt = run / "checkpoints" / "step_00000003"
    model = Transformer(cfg.model)
    CheckpointManager.load_weights(model, ckpt)
    loader = TokenLoader(tiny_data, "train", batch_size=4, seq_len=32, seed=cfg.train.seed)
    loader.load_state_dict(CheckpointManager.load_trainer_state(ckpt)["loader"])
    batch = loader.next_batch()
    model(batch[:, :-1], batch[:, 1:]).backward()
    assert sublayer_grad_norms(model) == pytest.approx(logged[4], rel=1e-4)
    assert CheckpointManager(run).latest().name == "step_00000004"


# ---- the command ---------------------------------------------------------------------------

def gradflow_parser():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["gradflow"]


def cli(capsys, *args):
    code = main(["gradflow", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_deep_profile_says_what_it_runs_before_it_starts(capsys, tiny_data, monkeypatch):
    """`keel gradflow --sublayers 200000` passed the size guard, then printed nothing for minutes;
    from LONG_SUBLAYERS sub-layers on (lowered to 4 here) each profile is announced first, the
    shallower one is not."""
    monkeypatch.setattr(gradflow, "LONG_SUBLAYERS", 4)
    code, _, err = cli(capsys, "--residual", "keel", "--sublayers", "2,4", "--d-model", 16, "--seq-len", 8,
                       "--batch-size", 1, "--threads", 1, "--jacobian-iters", 2, "--set", f"data.path={tiny_data}",
                       "--set", "model.vocab_size=512")
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("profiling ")]
    assert lines == ["profiling keel at 4 sub-layers: building the model, then one forward and backward pass and 2 "
                     "Jacobian products through every sub-layer (time grows with the depth; Ctrl-C stops)"], err
    # and how far it is, with the time left, at every tenth of the sub-layers (here each of the 4)
    eta = re.findall(r"gradflow: Jacobians of sub-layer (\d) of 4, about \d+ s left", err)
    assert eta == ["1", "2", "3"], err


def test_cli_json_schema_and_plot(capsys, tiny_data, tmp_path):
    png = tmp_path / "gf.png"
    code, out, err = cli(capsys, "--residual", "post_ln,keel,hybridnorm", "--sublayers", "2,4", "--json",
                         "--plot", png, "--d-model", 32, "--seq-len", 16, "--batch-size", 2, "--threads", 1,
                         "--jacobian-iters", 5, "--set", f"data.path={tiny_data}", "--set", "model.vocab_size=512")
    assert code == 0, err
    doc = json.loads(out)
    assert list(doc) == ["results"]
    assert [(r["residual"], r["sublayers"]) for r in doc["results"]] == [
        ("post_ln", 2), ("keel", 2), ("hybridnorm", 2), ("post_ln", 4), ("keel", 4), ("hybridnorm", 4)]
    for r in doc["results"]:
        L = r["sublayers"]
        assert r["blocks"] == L // 2
        for key in ("param_grad_norm", "stream_grad_norm", "jacobian_star"):
            assert len(r[key]) == L and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in r[key])
        assert isinstance(r["jacobian_product"], float) and r["jacobian_product"] > 0
        assert r["jacobian_product"] == pytest.approx(10 ** r["log10_jacobian_product"], rel=1e-9)
        assert r["jacobian_product"] == pytest.approx(math.prod(r["jacobian_star"]), rel=1e-9)
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob(".*"))  # no temp file left behind


def test_cli_from_run(capsys, gradflow_run, tmp_path):
    run, cfg = gradflow_run
    code, out, err = cli(capsys, "--run", run, "--json", "--seq-len", 16, "--batch-size", 2, "--threads", 1,
                         "--jacobian-iters", 5)
    assert code == 0, err
    (r,) = json.loads(out)["results"]
    assert r["residual"] == cfg.model.residual and r["sublayers"] == 4 and r["run"] == str(run)
    code, out, err = cli(capsys, "--run", run, "--seq-len", 16, "--batch-size", 2, "--threads", 1,
                         "--jacobian-iters", 5)
    assert code == 0 and "sub-layers" in err and cfg.model.residual in err  # the table is logged (stderr)


@pytest.mark.parametrize("flags,named", [
    (["--d-model", "96"], "--d-model"), (["--config", "demo"], "--config"),
    (["--set", "model.init_std=0.5"], "--set"), (["--residual", "keel", "--d-model", "32"], "--residual, --d-model")])
def test_cli_from_run_refuses_the_flags_it_would_ignore(capsys, gradflow_run, flags, named):
    """--d-model, --config and --set were ignored with --run (the profile was of the run's model)."""
    code, out, err = cli(capsys, "--run", gradflow_run[0], *flags)
    assert code == 2 and err == f"keel: error: --run takes the model and data from the run; drop {named}\n"


def test_cli_from_run_refuses_a_window_longer_than_the_model_reads(capsys, gradflow_run):
    """--seq-len above the run's max_seq_len was cut to it, silently."""
    run, cfg = gradflow_run
    n = cfg.model.max_seq_len + 1
    code, out, err = cli(capsys, "--run", run, "--seq-len", n)
    assert code == 2 and err == f"keel: error: --seq-len {n} is above model.max_seq_len = {n - 1} of {run}\n"


def test_profile_runs_refuses_a_window_of_no_tokens(gradflow_run):
    """From Python, ``seq_len=0`` was read as "the default" (``seq_len or ...``) and profiled windows of 64."""
    from keel.diagnostics.gradflow import profile_runs
    run, _ = gradflow_run
    with pytest.raises(KeelError, match="^--seq-len must be >= 1 token, got 0$"):
        profile_runs([run], 0, batch_size=1)


@pytest.mark.parametrize("args,msg", [
    (["--residual", "pre_ln,postln"], "unknown residual scheme 'postln'"),
    (["--sublayers", "16,15"], "--sublayers: 15 is not an even number"),
    (["--sublayers", "0"], "--sublayers: 0 is not an even number"),
    (["--sublayers", "sixteen"], "is not an integer number of sub-layers"),
    (["--sublayers", ","], "--sublayers needs at least one depth"),
    (["--run", "somewhere", "--residual", "keel"], "--run takes the model and data from the run; drop --residual"),
    (["--run", "/nonexistent/run"], "not a run directory"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--d-model", "80"], "--d-model 80 is not a multiple of the head dimension 32 (e.g. 64 or 96; a width below 32 "
                          "is one head of that width)"),
])
def test_cli_errors_are_one_line(capsys, args, msg):
    code, out, err = cli(capsys, *args)
    assert code == 2
    assert err.startswith("keel: error: ") and msg in err and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_summary_columns_line_up_for_every_scheme(scheme):
    """Every column of a summary line ends where its header ends, the longest scheme name
    (hyper_connections) included; before, names over 11 characters pushed the row right."""
    r = {"residual": scheme, "blocks": 32, "sublayers": 64, "d_model": 64, "loss": 3.25,
         "stream_ratio_first_last": 1.5, "stream_ratio_block1_last": 0.5, "param_grad_norm": [2.0, 1.0],
         "log10_jacobian_product": -1.25, "log10_jacobian_product_from_block1": -0.75, "seconds": 12.5}
    line, header = gradflow._summary_line(r), gradflow.SUMMARY_HEADER
    assert len(line) == len(header)
    ends = [m.end() for m in re.finditer(r"\S+", line)]
    assert ends[0] <= header.index(" blocks") and line.startswith(scheme + " ")
    assert line.split() == [scheme, "32", "64", "64", "3.250", "1.500e+00", "5.000e-01", "2.000e+00", "-1.25", "-0.75",
                            "12.5"]
    for value_end, word in zip(ends[1:], ["blocks", "sub-layers", "d_model", "loss", "0/L-1", "2/L-1", "0/L-1", "J*",
                                          "blk1+", "seconds"]):
        assert header[:value_end].endswith(word)


@pytest.mark.parametrize("scheme", ALL)
def test_full_jacobian_runs_for_every_scheme(scheme, val_batch):
    """`keel gradflow --full-jacobian` failed for hyper_connections and mhc: their first stream is
    the embedding expanded into n copies (stride 0), which a forward-mode tangent cannot be
    written into. Every scheme now gives one finite, positive norm per sub-layer."""
    torch.manual_seed(0)
    model = Transformer(cfg_for(scheme, n_layers=2, d_model=16))
    prof = profile_model(model, val_batch[:1, :9], jacobian_iters=8, full_jacobian=True)
    full = prof["full_jacobian"]
    assert len(full) == 4 and all(math.isfinite(x) and x > 0 for x in full)


@pytest.mark.parametrize("scheme", ALL)
def test_cli_from_a_run_of_every_scheme(scheme, capsys, tiny_data, tmp_path):
    """`keel gradflow --run R --full-jacobian` on a trained run of each scheme (it failed for a
    trained mhc run): one finite profile with a full-Jacobian norm per sub-layer, exit 0."""
    from conftest import tiny_overrides
    from keel.train import train

    run = tmp_path / "run"
    train(load_config(REPO / "keel" / "configs" / "demo.toml",
                      [*tiny_overrides(tiny_data, steps=2, eval_every=2, checkpoint_every=2, eval_tokens=64,
                                       sample_tokens=0), f"model.residual={scheme}"]), run)
    code, out, err = cli(capsys, "--run", run, "--full-jacobian", "--json", "--seq-len", 16, "--batch-size", 2,
                         "--threads", 1, "--jacobian-iters", 4)
    assert code == 0 and "Traceback" not in err, err
    (r,) = json.loads(out)["results"]
    assert r["residual"] == scheme and r["sublayers"] == 4
    assert len(r["full_jacobian"]) == 4 and all(math.isfinite(x) and x > 0 for x in r["full_jacobian"])


@pytest.mark.parametrize("d_model,heads", [(16, (1, 16)), (30, (1, 30)), (32, (1, 32)), (64, (2, 32)), (96, (3, 32)),
                                           (48, None), (80, None)])
def test_init_width_has_the_head_dim_the_help_states(d_model, heads):
    """`--help` said head_dim 32, yet 80 was two heads of 40 and 48 one of 48: a width above 32
    is a multiple of 32 (heads of 32) or refused, a width below 32 is one head, as the help says."""
    help_text = next(a.help for a in gradflow_parser()._actions if a.dest == "d_model")
    assert "a multiple of 32 (heads of head_dim 32), or below 32 for one head" in help_text
    if heads is None:
        with pytest.raises(KeelError, match=f"--d-model {d_model} is not a multiple of the head dimension 32"):
            gradflow._init_config(load_config(None), "keel", 4, d_model, 16, 512)
        return
    m = gradflow._init_config(load_config(None), "keel", 4, d_model, 16, 512)
    assert (m.n_heads, m.head_dim, m.d_model) == (*heads, d_model)


def test_cli_data_is_where_keel_train_finds_it(capsys, tmp_path, monkeypatch):
    """Without data.path, gradflow prepares the config's data.source + data.tokenizer once under
    data.cache_dir (data/ in the working folder) -- the dataset keel train then reuses, as its
    --help says -- and finds it there the next time."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i + 1}\n" * 40)
    monkeypatch.chdir(tmp_path)
    sets = [f"data.source={corpus}", "data.tokenizer=bpe:300", "data.val_fraction=0.5"]
    help_text = next(a.help for a in gradflow_parser()._actions if a.dest == "config")
    assert "as keel train finds it" in help_text and "data.cache_dir (default data/ in the working folder)" in help_text
    args = ["--residual", "keel", "--sublayers", "2", "--d-model", 16, "--seq-len", 8, "--batch-size", 1,
            "--jacobian-iters", 2, *[x for kv in sets for x in ("--set", kv)]]
    code, _, err = cli(capsys, *args)
    assert code == 0, err
    (prepared,) = (tmp_path / "data").iterdir()
    assert f"prepared {Path('data') / prepared.name}:" in err
    assert find_data(load_config(REPO / "keel" / "configs" / "demo.toml", sets)) == Path("data") / prepared.name
    code, _, err = cli(capsys, *args)
    assert code == 0 and f"reusing cached dataset {Path('data') / prepared.name}" in err, err
