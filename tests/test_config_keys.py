"""One declaration per config key (issue 20, item 2): the load-time check, `keel config`'s help,
the CLI flags that mirror a key and the sweep/study overrides all come from it."""

import argparse
import ast
import dataclasses
import io
import json
import math
import re
import tokenize
from pathlib import Path

import pytest
import tomli_w

from keel import KeelError
from keel.cli import build_parser, main
from keel.config import (Config, DataConfig, ModelConfig, TrainConfig, apply_overrides, checked_copy, config_from_dict,
                         load_config)
from keel.keys import choices, key_rule, key_type
from keel.experiments.study import lrs as SLrs, spec as SS
from keel.experiments.sweep import build_jobs

KEEL = Path(__file__).resolve().parents[1] / "keel"
SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
FIELDS = [(s, cls, f) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
BOUNDS = ("ge", "gt", "le", "lt")


def _is_class_var(stmt: ast.AnnAssign) -> bool:
    """``NAME: ClassVar[...] = ...``: a section's own setting (ON_RESUME), not a key."""
    return isinstance(stmt.annotation, ast.Subscript) and getattr(stmt.annotation.value, "id", "") == "ClassVar"


def test_every_key_has_exactly_one_declaration():
    """Each key is one `name: type = key(default, help, rule...)` line group: no docstring
    `Attributes` entry, no comment beside it, no second assignment."""
    source = (KEEL / "config.py").read_text()
    tree = ast.parse(source)
    comments = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    for node in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in {c.__name__ for c in SECTIONS.values()}):
        assert "Attributes" not in (ast.get_docstring(node) or ""), node.name
        keys = [s for s in node.body if isinstance(s, ast.AnnAssign) and not _is_class_var(s)]
        names = [s.target.id for s in keys]
        assert len(names) == len(set(names)) == len(dataclasses.fields(SECTIONS[node.name[:-6].lower()]))
        for stmt in keys:
            assert isinstance(stmt.value, ast.Call) and stmt.value.func.id == "key", stmt.target.id
            assert not comments & set(range(stmt.lineno - 1, stmt.end_lineno + 1)), f"comment at {stmt.target.id}"
    assert "_field_comments" not in source and "_docstring_attributes" not in source
    for _, _, f in FIELDS:
        assert f.metadata["help"].strip() and set(BOUNDS) <= set(f.metadata), f.name


def test_no_module_restates_a_keys_allowed_values():
    """The allowed values of each Literal key are written once, in keel/config.py."""
    hits = []
    for s, cls, f in FIELDS:
        values = choices(cls, f.name)
        if not values or len(values) < 2:
            continue
        pair = re.compile(r"""['"]{}['"]\s*(,|or)\s*['"]{}['"]""".format(*map(re.escape, values[:2])))
        for p in KEEL.rglob("*.py"):
            if p.name != "config.py" and pair.search(p.read_text()):
                hits.append(f"{s}.{f.name}: {p.relative_to(KEEL)}")
    assert hits == []


def _rule_declared(cls, f) -> bool:
    return any(f.metadata[b] is not None for b in BOUNDS) or bool(choices(cls, f.name)) or f.metadata["nonempty"]


def test_keel_config_prints_every_key_with_type_default_rule_and_help(capsys):
    assert main(["config"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")}
    assert set(lines) == {f"{s}.{f.name}" for s, _, f in FIELDS}
    for s, cls, f in FIELDS:
        line = lines.pop(f"{s}.{f.name}")
        default = getattr(cls(), f.name)
        shown = "unset" if default is None else json.dumps(default)
        assert f" {key_type(cls, f.name).text} = {shown}  {f.metadata['help']}" in line, line
        for v in choices(cls, f.name) or ():
            assert repr(v) in line
        for b in BOUNDS:
            if f.metadata[b] is not None:
                assert str(f.metadata[b]).rstrip("0").rstrip(".") in line.replace("2**32 - 1", str(2**32 - 1)), line
        rule = key_rule(cls, f.name)
        assert bool(rule) == _rule_declared(cls, f) and line.endswith(f"  (must be {rule})" if rule else "")


def _bad_values():
    """One value outside each key's declaration: (dotted key, value, rule)."""
    out = []
    for s, cls, f in FIELDS:
        m, t = f.metadata, key_type(cls, f.name)
        step = 1 if t.base is int else 0.5
        bad = ([m["ge"] - step] if m["ge"] is not None else []) + ([m["gt"]] if m["gt"] is not None else []) \
            + ([m["le"] + step] if m["le"] is not None else []) + ([m["lt"]] if m["lt"] is not None else [])
        if t.base is float and bad:
            bad += [math.inf]
        if choices(cls, f.name) and t.base is not int:  # (model.vocab_size's "auto": a coercion error)
            bad.append(["nope"] if t.base is list else "nope")
        if m["nonempty"]:
            bad.append("")
        out += [(f"{s}.{f.name}", t.base(v) if t.base in (int, float) else v, key_rule(cls, f.name)) for v in bad]
    return out


BAD = _bad_values()


def _message(dotted, value, rule):
    item = value[0] if isinstance(value, list) else value
    return f"{dotted} must be {rule}, got {item!r}"


@pytest.mark.parametrize("dotted,value,rule", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_generated_check_rejects_each_value_outside_the_declaration(dotted, value, rule):
    """Same one-line message from a --set string, a typed override, and the sweep's and the study's paths."""
    text = f"{dotted}={json.dumps(value) if not (isinstance(value, float) and math.isinf(value)) else 'inf'}"
    for overrides in ([text], [(dotted, value)], {dotted: value}):
        with pytest.raises(KeelError) as e:
            load_config(None, overrides)
        assert str(e.value) == _message(dotted, value, rule)
    with pytest.raises(KeelError) as e:
        build_jobs(None, {dotted: [value]}, data_path="data")
    assert str(e.value) == _message(dotted, value, rule)
    forced = SS.GRID_KEYS | {"train.steps", "train.warmup_steps"}  # the ramp's own keys win over a group's
    if dotted not in SS.GRID_KEYS:
        for kind in ("train",) if dotted in forced else ("train", "ramp"):
            g = SS.Group(name="g", schemes=["keel"], sublayers=[2], seeds=[0], lrs=[1e-3], kind=kind, sets=[(dotted, value)])
            study = SS.Study(name="t", scale="t", description="", note="", base="demo", sets=[], groups=[g], claims=[])
            with pytest.raises(KeelError) as e:
                SLrs.group_jobs(study, g, "data", Path("out"))
            assert str(e.value) == _message(dotted, value, rule)


def test_every_ranged_key_has_a_bad_value_case():
    assert {k for k, _, _ in BAD} == {f"{s}.{f.name}" for s, cls, f in FIELDS if _rule_declared(cls, f)}


def test_typed_overrides_equal_the_strings_and_keep_their_type():
    typed = {"train.lr": 1e-3, "train.progress": False, "train.loggers": ["jsonl", "wandb"], "model.residual": "pre_ln",
             "train.steps": 12.0, "model.alpha": 2.5}
    strings = ["train.lr=1e-3", "train.progress=false", "train.loggers=jsonl,wandb", "model.residual=pre_ln",
               "train.steps=12", "model.alpha=2.5"]
    assert load_config(None, typed) == load_config(None, strings) == load_config(None, list(typed.items()))
    assert load_config(None, {"data.tokenizer": "1e3"}).data.tokenizer == "1e3"  # no text round trip
    assert load_config(None, ["data.tokenizer=1e3"]).data.tokenizer == "1e3"  # a text key keeps the text typed
    d = {"train": {"lr": 0.5}}
    assert apply_overrides(d, [("train.lr", 0.1), "train.lr=0.2"]) == {"train": {"lr": 0.2}} and d["train"]["lr"] == 0.5
    with pytest.raises(KeelError, match="unknown config key train.lrr"):
        load_config(None, {"train.lrr": 1.0})
    with pytest.raises(KeelError, match="train.steps must be an integer, got 1.5"):
        build_jobs(None, {"train.steps": [1.5]}, data_path="data")


@pytest.mark.parametrize("sets,lines", [
    (["model.residual=pre_ln", "model.alpha=4"], ["model.alpha is read only by keel; model.residual=pre_ln ignores it"]),
    (["model.residual=keel", "model.alpha=4"], []),
    (["model.residual=pre_ln", "model.hc_streams=4", "model.mix_ln_ratio=0.25"], []),  # the defaults: not set
    (["model.residual=keel", "model.hc_streams=2", "model.attn_res_variant=full"],
     ["model.hc_streams is read only by hyper_connections and mhc; model.residual=keel ignores it",
      "model.attn_res_variant is read only by attn_res; model.residual=keel ignores it"]),
    (["model.residual=mhc", "model.hc_streams=2", "model.hc_dynamic=false"],
     ["model.hc_dynamic is read only by hyper_connections; model.residual=mhc ignores it"]),
])
def test_a_scheme_specific_key_the_scheme_ignores_is_named(sets, lines):
    """A model key only some schemes read (declared on their classes, ``config_keys``), set to
    a non-default value for a scheme that does not read it: one line each, naming its readers."""
    from keel.model import ignored_keys

    assert ignored_keys(load_config(None, sets).model) == lines


@pytest.mark.parametrize("n_layers,ratio,warned", [(3, 0.25, True), (4, 0.25, False), (1, 0.9, True),
                                                     (2, 0.5, False), (2, 0.0, False), (2, 1.0, False)])
def test_a_mix_ln_without_a_post_ln_block_is_named(n_layers, ratio, warned):
    """Mix-LN's Post-LN blocks are floor(ratio * n_layers) (Li et al. 2024): with the default 0.25
    and fewer than 4 blocks there are none, and the model trained as pre_ln without a word."""
    import math

    from keel.model import get_scheme

    cfg = load_config(None, ["model.residual=mix_ln", f"model.n_layers={n_layers}",
                             f"model.mix_ln_ratio={ratio}"]).model
    notes = get_scheme("mix_ln").config_notes(cfg)
    assert bool(notes) == warned == (math.floor(ratio * n_layers) == 0 and ratio > 0)
    assert all("exactly pre_ln" in n for n in notes)
    assert get_scheme("pre_ln").config_notes(cfg) == []


def test_an_unknown_key_suggests_the_closest_one(tmp_path):
    """A typo gave "unknown config key train.lrr" alone; now the closest declared key is named,
    from --set, a TOML file or Python, in any section; nothing when no key is close."""
    for sets, msg in [(["train.lrr=1e-3"], "unknown config key train.lrr (did you mean train.lr?)"),
                      (["model.hc_stream=2"], "unknown config key model.hc_stream (did you mean model.hc_streams?)"),
                      (["model.lr=1e-3"], "unknown config key model.lr (did you mean train.lr?)"),
                      (["data.cachedir=x"], "unknown config key data.cachedir (did you mean data.cache_dir?)"),
                      (["train.zzqqxx=1"], "unknown config key train.zzqqxx"),
                      (["trian.lr=1"], "unknown config section [trian] (did you mean [train]? the sections are "
                                       "model, data, train)")]:
        with pytest.raises(KeelError) as e:
            load_config(None, sets)
        assert str(e.value) == msg
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nstpes = 3\n")
    with pytest.raises(KeelError, match=re.escape("unknown config key train.stpes (did you mean train.steps?)")):
        load_config(toml)
    cfg = Config()
    cfg.train.seeed = 1
    with pytest.raises(KeelError, match=re.escape("unknown config key train.seeed (did you mean train.seed?)")):
        checked_copy(cfg)


@pytest.mark.parametrize("text, msg", [
    ("steps = 5\n", "config key steps is outside a section: put it under [train]"),
    ("residual = 'keel'\n[train]\nlr = 1e-3\n", "config key residual is outside a section: put it under [model]"),
    ("stpes = 5\n", "unknown config section [stpes] (the sections are model, data, train)"),
    ("train = 5\n", "config section [train] must be a table")])
def test_a_key_above_every_section_is_named_as_a_key(tmp_path, text, msg):
    """A TOML file with `steps = 5` above every [section] said "unknown config section [steps]"."""
    toml = tmp_path / "c.toml"
    toml.write_text(text)
    with pytest.raises(KeelError) as e:
        load_config(toml)
    assert str(e.value) == msg


def test_sweep_preset_set_table_is_applied_typed_in_order():
    jobs = build_jobs(None, {"train.lr": [0.01]}, [("train.steps", 7), "train.steps=9", ("model.residual", "post_ln")],
                      data_path="/d 1")
    cfg = jobs[0].config
    assert cfg["train"]["steps"] == 9 and cfg["model"]["residual"] == "post_ln" and cfg["data"]["path"] == "/d 1"
    assert cfg["train"]["lr"] == 0.01 and cfg["train"]["progress"] is False


@pytest.mark.parametrize("command,flag,dotted", [
    ("prepare", "source", "data.source"), ("prepare", "tokenizer", "data.tokenizer"),
    ("prepare", "cache_dir", "data.cache_dir"), ("prepare", "val_fraction", "data.val_fraction"),
    ("prepare", "max_bytes", "data.max_bytes"), ("prepare", "text_field", "data.text_field"),
    ("generate", "device", "train.device"), ("eval", "device", "train.device"), ("ablate", "device", "train.device"),
])
def test_cli_flags_that_mirror_a_key_take_its_declared_default(command, flag, dotted):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if a.dest == flag)
    section, name = dotted.split(".")
    field = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    assert action.default == getattr(SECTIONS[section](), name) and field.metadata["help"] in action.help


OLD_RUN_CONFIG = """\
[model]
vocab_size = 512
vocab_multiple = 64
d_model = 32
n_layers = 1
n_heads = 2
n_kv_heads = 1
d_ff = 64
max_seq_len = 32
rope_theta = 10000.0
norm_eps = 1e-05
tie_embeddings = false
init_std = 0.02
residual = "pre_ln"
keel_first_layer_rule = true
mix_ln_ratio = 0.25

[data]
source = "builtin:python-stdlib"
tokenizer = "bpe:512"
path = "data/python-stdlib-bpe512-97c7d0ae"
cache_dir = "data"
val_fraction = 0.05
max_bytes = 300000
text_field = "text"

[train]
steps = 6
lr = 0.01
min_lr = 1e-07
warmup_steps = 2
schedule = "cosine"
decay_fraction = 0.1
batch_size = 4
seq_len = 32
grad_accum = 1
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
eval_every = 6
eval_tokens = 1024
checkpoint_every = 100
keep_checkpoints = 2
log_every = 10
seed = 1
device = "auto"
precision = "auto"
max_bad_steps = 10
sample_tokens = 0
sample_prompt = "def "
progress = false
stop_on_divergence = false
divergence_warnings = true
divergence_reference = ""
gradflow_every = 0
parallelism = "ddp"
activation_checkpointing = "none"
checkpoint_k = 2
compile = false
eval_tasks = ""
eval_tasks_every = 0
eval_tasks_limit = 100
loggers = [
    "jsonl",
]
wandb_mode = "offline"
wandb_project = "keel"
"""


def test_an_old_runs_config_toml_still_loads(tmp_path):
    """A config.toml written before the residual bench's keys existed (a run of the CPU grid)."""
    import tomllib

    p = tmp_path / "config.toml"
    p.write_text(OLD_RUN_CONFIG)
    d = tomllib.loads(OLD_RUN_CONFIG)
    cfg = load_config(p)
    renamed = {"checkpoint_k": "activation_checkpoint_k"}  # train.checkpoint_k was renamed (keel.keys.RENAMED_KEYS)
    assert all(cfg.to_dict()[s][renamed.get(k, k)] == v for s in d for k, v in d[s].items())
    assert cfg.model.hc_streams == 4 and config_from_dict(cfg.to_dict()) == cfg


def test_a_renamed_key_is_read_under_its_old_name_everywhere():
    """train.checkpoint_k (recomputation, easily read as checkpoint saving) is now
    train.activation_checkpoint_k: an old config file, an old --set and an old checkpoint's saved
    config all mean the new key, and a resume sees no change."""
    from keel.train.resume import config_changes

    assert load_config(None, ["train.checkpoint_k=3"]).train.activation_checkpoint_k == 3
    old = Config().to_dict()
    old["train"]["checkpoint_k"] = old["train"].pop("activation_checkpoint_k")
    assert config_from_dict(old) == Config()
    assert config_changes(old, Config()) == {}
    old["train"]["checkpoint_k"] = 4
    assert config_changes(old, Config()) == {"train.activation_checkpoint_k": {"old": 4, "new": 2}}


DEPRECATED = "train.checkpoint_k is now train.activation_checkpoint_k; update your config"


@pytest.fixture
def renames_said(monkeypatch, caplog):
    """The deprecation lines logged from here on (each old name is said once per process: start afresh)."""
    import keel.keys

    monkeypatch.setattr(keel.keys, "_RENAMES_SAID", set(), raising=False)
    caplog.set_level("WARNING", logger="keel")
    return lambda: [r.getMessage() for r in caplog.records if "is now" in r.getMessage()]


def test_an_old_key_name_in_a_config_file_or_set_is_said_once(tmp_path, renames_said):
    """It was mapped to the new name silently, so the user never learned to update the config."""
    p = tmp_path / "mine.toml"
    p.write_text("[train]\ncheckpoint_k = 4\n")
    assert load_config(p).train.activation_checkpoint_k == 4
    assert renames_said() == [DEPRECATED]
    assert load_config(p, ["train.checkpoint_k=3"]).train.activation_checkpoint_k == 3  # once per key
    assert renames_said() == [DEPRECATED]


@pytest.mark.parametrize("how", ["--set", "typed pair", "mapping"])
def test_an_old_key_name_in_an_override_is_said(how, renames_said):
    overrides = {"--set": ["train.checkpoint_k=3"], "typed pair": [("train.checkpoint_k", 3)],
                 "mapping": {"train.checkpoint_k": 3}}[how]
    assert load_config(None, overrides).train.activation_checkpoint_k == 3
    assert renames_said() == [DEPRECATED]


def test_an_old_key_name_keel_wrote_itself_is_read_quietly(tmp_path, renames_said):
    """An older run's config.toml and its checkpoint's config: the user has nothing to update there
    (a resume rewrites config.toml with the new name), so a resume says nothing about the rename."""
    from keel.run import Run
    from keel.train.resume import check_config_changes, config_changes

    old = Config().to_dict()
    old["train"]["checkpoint_k"] = old["train"].pop("activation_checkpoint_k")
    (tmp_path / "config.toml").write_text(tomli_w.dumps(old))
    assert load_config(tmp_path / "config.toml", stored=True) == Config() == Run(tmp_path).config
    assert config_from_dict(old, stored=True) == Config() and config_changes(old, Config()) == {}
    assert check_config_changes({"step": 3, "config": old}, Config(), tmp_path) == {}
    assert check_config_changes({"step": 3}, Config(), tmp_path) == {}  # an older checkpoint: config.toml
    assert renames_said() == []
    assert load_config(tmp_path / "config.toml", ["train.checkpoint_k=5"], stored=True).train.activation_checkpoint_k == 5
    assert renames_said() == [DEPRECATED]  # what the user typed is still said


def test_resume_policy_is_declared_on_each_key():
    """A resume refuses every model key, every data key but where the dataset lies, and the
    train keys that make another run (seed, batch shape); it reports the LR for the schedule's
    keys; a key an older run had and no section declares takes its section's policy."""
    from keel.config import on_resume

    every = [f"{s}.{f.name}" for s, _, f in FIELDS]
    refused = {k for k in every if on_resume(k) == "refuse"}
    assert refused == ({k for k in every if k.startswith(("model.", "data."))} - {"data.path", "data.cache_dir"}
                       | {"train.seed", "train.batch_size", "train.seq_len", "train.grad_accum"})
    assert {k for k in every if on_resume(k) == "schedule"} == {
        "train.lr", "train.min_lr", "train.warmup_steps", "train.steps", "train.schedule", "train.decay_fraction"}
    assert [on_resume(k) for k in ("model.gone", "data.gone", "train.gone", "nosection.x")] == [
        "refuse", "refuse", "apply", "apply"]


def test_callback_keys_come_from_their_declarations():
    """The keys only a callback honours, and when a config asks for them."""
    from keel.train.callbacks import CALLBACK_KEYS

    assert sorted(CALLBACK_KEYS) == ["train.divergence_reference", "train.eval_tasks", "train.gradflow_every",
                                     "train.stop_on_divergence"]
    asks = {k for k, test in CALLBACK_KEYS.items() if test(TrainConfig())}
    assert asks == set()
    tc = TrainConfig(gradflow_every=5, eval_tasks="hellaswag", eval_tasks_every=0)
    assert {k for k, test in CALLBACK_KEYS.items() if test(tc)} == {"train.gradflow_every"}
    tc.eval_tasks_every = 10
    assert {k for k, test in CALLBACK_KEYS.items() if test(tc)} == {"train.gradflow_every", "train.eval_tasks"}


@pytest.mark.parametrize("raw", ["3.10", "1e3", "0x10", "1_000", "true", "[1, 2]"])
@pytest.mark.parametrize("key", ["train.sample_prompt", "data.source", "train.wandb_project"])
def test_a_text_key_keeps_the_text_as_typed(key, raw):
    """`--set train.sample_prompt=3.10` was read as TOML first: the prompt became "3.1" (1e3
    "1000.0", 0x10 "16", 1_000 "1000", true "True"); a text key takes the characters typed."""
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, [f"{key}={raw}"]), section), name) == raw
    assert getattr(getattr(load_config(None, [f'{key}="{raw}"']), section), name) == raw  # quoted: TOML's string


def test_a_number_key_still_reads_toml_numbers():
    cfg = load_config(None, ["train.lr=1e-3", "train.steps=1_000", "model.vocab_size=0x1000", "train.compile=true"])
    assert (cfg.train.lr, cfg.train.steps, cfg.model.vocab_size, cfg.train.compile) == (1e-3, 1000, 4096, True)


def test_a_step_count_no_run_could_reach_is_refused():
    """train.steps=1e20 (a slip for 1e2, say) was accepted: a run that would never end."""
    with pytest.raises(KeelError, match=r"^train.steps must be between 1 and 1e\+12, got 100000000000000000000$"):
        load_config(KEEL / "configs" / "demo.toml", ["train.steps=1e20"])
    assert load_config(KEEL / "configs" / "demo.toml", ["train.steps=1e6"]).train.steps == 10**6
