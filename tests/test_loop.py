"""Looped models (``model.loop_prelude`` / ``loop_core`` / ``loop_repeats`` / ``loop_sampling``): a
prelude of P blocks, a core of C blocks applied R times with shared weights, a coda of Q blocks.
Each property against its definition, parametrized over residual schemes and loop shapes."""

import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import statistics

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

from conftest import REPO, tiny_overrides
from spawn import spawn_training
from keel import KeelError, ModelConfig, Transformer
from keel.config import load_config
from keel.diagnostics.ablate import ablate_markdown, ablate_model
from keel.diagnostics.gradflow import profile_model
from keel.data import TokenLoader, validation_tokens
from keel.model import (SCHEMES, KVCache, RMSNorm, Residual, count_parameters, flops_per_token, largest_loop_count,
                         loop_count)
from keel.run import Run
from keel.train import train
from keel.train.callbacks import Callback
from keel.train.checkpoint import CheckpointManager
from keel.train.nll import mean_nll
from keel.train.parallelize import apply_activation_checkpointing
from keel.train.sampling import sample_text

ALL = sorted(SCHEMES)
LOOPING = [s for s in ALL if s != "attn_res"]  # attn_res refuses a loop (test_bad_loop_configs)
SHAPES = [(1, 2, 3, 1), (2, 1, 4, 0), (0, 2, 2, 1), (1, 1, 1, 1), (1, 3, 2, 0)]  # (P, C, R, Q)
NO_LOOP = dict(loop_prelude=0, loop_core=0, loop_repeats=1, loop_sampling="fixed")

pytestmark = pytest.mark.usefixtures("one_thread")


def looped_cfg(scheme, P, C, R, Q, **kw):
    """A small looped model; Keel with P = 0 needs its first-layer rule off (test_bad_loop_configs)."""
    base = dict(vocab_size=61, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=24, residual=scheme,
                n_layers=P + C + Q, loop_prelude=P, loop_core=C, loop_repeats=R, mix_ln_ratio=0.5)
    if scheme == "keel" and P == 0:
        base["keel_first_layer_rule"] = False
    return ModelConfig(**{**base, **kw})


def order_from_definition(P, C, R, Q):
    """Blocks of the unrolled model, by the definition: prelude once, the core R times, the coda once."""
    return list(range(P)) + [P + c for _ in range(R) for c in range(C)] + [P + C + q for q in range(Q)]


def perturbed(model):
    """Gains off 1 and the schemes' own maps off their init (some start where they change nothing)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(torch.rand_like(m.weight) + 0.5)
            if isinstance(m, Residual) or m is model.stream:
                for p in m.parameters(recurse=False):
                    p.add_(0.1 * torch.randn_like(p))
    return model


def unrolled_copies(model, order):
    """The unrolled model: ``len(order)`` blocks, block i a copy of the looped model's block order[i]
    (copies of one core block hold one state dict), the rest of the model copied as it is."""
    flat = Transformer(dataclasses.replace(model.cfg, n_layers=len(order), **NO_LOOP)).to(torch.float64)
    flat.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("blocks.")}, strict=False)
    flat.blocks = nn.ModuleList(copy.deepcopy(model.blocks[b]) for b in order)
    return flat


# ---- the definition: R applications of one shared core = the unrolled model of copies (float64) ----

@pytest.mark.parametrize("scheme", LOOPING)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "P{}C{}R{}Q{}".format(*s))
def test_loop_equals_unrolled_copies(scheme, shape):
    """Logits at R and at another count, and gradients: the gradient of a shared core weight is the
    sum of the gradients of its R copies in the unrolled model."""
    P, C, R, Q = shape
    torch.manual_seed(0)
    model = perturbed(Transformer(looped_cfg(scheme, *shape)).to(torch.float64))
    ids = torch.randint(0, 61, (2, 9))
    targets = torch.roll(ids, -1, 1)
    for r in (R, R + 2):
        flat = unrolled_copies(model, order_from_definition(P, C, r, Q))
        torch.testing.assert_close(model(ids, loops=r), flat(ids), rtol=1e-12, atol=1e-12)
    flat = unrolled_copies(model, order_from_definition(P, C, R, Q))
    model.zero_grad()
    model(ids, targets).backward()
    flat(ids, targets).backward()
    order = order_from_definition(P, C, R, Q)
    for b, block in enumerate(model.blocks):
        copies = [flat.blocks[i] for i, src in enumerate(order) if src == b]
        assert len(copies) == (R if P <= b < P + C else 1)
        for name, p in block.named_parameters():
            want = sum(dict(c.named_parameters())[name].grad for c in copies)
            torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-12, msg=f"blocks.{b}.{name}")


@pytest.mark.parametrize("scheme", LOOPING)
def test_one_repeat_is_the_plain_model(scheme):
    """R = 1 (the core once) is the model of the same blocks without a loop, bit for bit."""
    cfg = looped_cfg(scheme, 1, 2, 1, 1)
    torch.manual_seed(3)
    looped = Transformer(cfg)
    torch.manual_seed(3)
    plain = Transformer(dataclasses.replace(cfg, **NO_LOOP))
    ids = torch.randint(0, 61, (2, 7))
    assert torch.equal(looped(ids), plain(ids))


# ---- the effective depth feeds every depth-dependent formula ------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "P{}C{}R{}Q{}".format(*s))
def test_keel_alpha_is_the_effective_depth(shape):
    """Keel (arXiv 2601.19895, Sec. 3): x <- Norm_out(alpha x + F(Norm_in(x))), alpha = L, L the
    sub-layers the network applies: 2 (P + R C + Q); the first-layer rule (alpha = 1) on block 0."""
    P, C, R, Q = shape
    cfg = looped_cfg("keel", *shape)
    L = 2 * (P + R * C + Q)
    assert cfg.n_sublayers == L and cfg.effective_layers == P + R * C + Q
    model = Transformer(cfg)
    for b, block in enumerate(model.blocks):
        first = cfg.keel_first_layer_rule and b == 0
        assert block.attn_residual.alpha == (1.0 if first else L)
        assert block.ffn_residual.alpha == (1.0 if first else L)
    assert Transformer(looped_cfg("keel", *shape, alpha=3.5)).blocks[-1].ffn_residual.alpha == 3.5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "P{}C{}R{}Q{}".format(*s))
def test_deepnorm_constants_and_init_take_the_effective_depth(shape):
    """DeepNet (arXiv 2203.00555, Fig. 2), decoder-only, L sub-layers: alpha = L^(1/4), beta = (4L)^(-1/4),
    the value/output/FFN weights Xavier-normal with gain beta; L = 2 (P + R C + Q)."""
    P, C, R, Q = shape
    L = 2 * (P + R * C + Q)
    cfg = looped_cfg("deepnorm", *shape, d_model=256, n_heads=4, n_kv_heads=4, d_ff=512)
    torch.manual_seed(0)
    model = Transformer(cfg)
    for block in model.blocks:
        for unit in (block.attn_residual, block.ffn_residual):
            assert unit.alpha == pytest.approx(L ** 0.25) and unit.beta == pytest.approx((4 * L) ** -0.25)
    w = model.blocks[-1].ffn.w2.weight
    assert w.std().item() == pytest.approx((4 * L) ** -0.25 * math.sqrt(2 / sum(w.shape)), rel=0.03)


def test_parameters_and_flops_of_a_looped_model():
    """Shared weights count once; the FLOPs per token are the unrolled model's (PaLM App. B)."""
    cfg = looped_cfg("pre_ln", 1, 2, 3, 1)
    model = Transformer(cfg)
    assert count_parameters(cfg) == model.num_params() == Transformer(dataclasses.replace(cfg, **NO_LOOP)).num_params()
    unrolled = dataclasses.replace(cfg, n_layers=1 + 3 * 2 + 1, **NO_LOOP)
    assert flops_per_token(cfg, 16) == flops_per_token(unrolled, 16)
    assert flops_per_token(unrolled, 16) == 6 * count_parameters(unrolled, non_embedding=True) + 12 * 8 * 16 * 16


# ---- the default model is the model before loops, bit for bit ------------------------------------

# Recorded with the code before loops existed (torch 2.13 CPU) for the schemes of then, and for a scheme
# added since from its own first commit: per scheme and shape, the first 16 hex digits of sha256 over the
# state dict (names, shapes, dtypes, bytes, in order), the next N(0, 1) draw after building (the init's RNG
# consumption), and the sum and absolute sum of the logits. A torch whose CPU generator draws other numbers
# changes them all: regenerate them from the commit before the loop (a later scheme: from its first commit).
REFERENCE = {
    "attn_res/plain": ("50405debb371c526", 2.1108837127685547, -0.871553137056253, 113.12710610448084),
    "attn_res/tied": ("66e867a129eb37bf", 0.14251293241977692, 7.254884371319349, 105.03439832247022),
    "deepnorm/plain": ("f5fe052b6c17cbf4", -0.06983988732099533, -0.8082587451972358, 158.32307463368124),
    "deepnorm/tied": ("85058e95889edcf0", -0.24215790629386902, 16.618764352002472, 163.2158592144333),
    "hybridnorm/plain": ("8ef1685b54b27110", 2.1108837127685547, -11.683262362603273, 162.75333425196732),
    "hybridnorm/tied": ("9d6ed4527387261b", 0.14251293241977692, 6.730519229366109, 157.27167068491144),
    "hyper_connections/plain": ("bd6b0c535e9936a0", 2.1108837127685547, -2.7213557279064844, 159.33691183788687),
    "hyper_connections/tied": ("20b3cbb6513dd758", 0.14251293241977692, 14.96803921918763, 162.16688511813845),
    "keel/plain": ("a58617e6becb3c87", 2.1108837127685547, -8.141664661714458, 158.36737283215916),
    "keel/tied": ("30e9f5ac695c8272", 0.14251293241977692, 16.481905124674086, 160.83588002293254),
    "mhc/plain": ("e2d600dbced76910", 2.1108837127685547, -1.7134689607628388, 162.14151850556664),
    "mhc/tied": ("b8ef4727987d1f89", 0.14251293241977692, 7.565575645741774, 161.5288530831749),
    "mix_ln/plain": ("52ef8f0575730373", 2.1108837127685547, -1.6866680884795642, 160.48380558100507),
    "mix_ln/tied": ("81b701f4e7fa8769", 0.14251293241977692, 17.84919445568812, 164.20452524445136),
    "peri_ln/plain": ("2a8dc8efee5ed350", 2.1108837127685547, -8.801837145092577, 169.94565496618816),
    "peri_ln/tied": ("6bea7d097a888b51", 0.14251293241977692, 5.101717795681907, 155.57495001304778),
    "post_ln/plain": ("bc8dbaa5195266f1", 2.1108837127685547, -2.371758148408844, 158.5621724299417),
    "post_ln/tied": ("5f03371e42845b77", 0.14251293241977692, 17.84926373414055, 164.20445802000177),
    "pre_ln/plain": ("52ef8f0575730373", 2.1108837127685547, -1.6866680884795642, 160.48380558100507),
    "pre_ln/tied": ("81b701f4e7fa8769", 0.14251293241977692, 7.595923644053983, 160.41065491261543),
}
REFERENCE_SHAPES = {"plain": {}, "tied": dict(n_kv_heads=1, tie_embeddings=True, n_layers=4)}


def state_hash(model):
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("shape", sorted(REFERENCE_SHAPES))
def test_default_model_is_unchanged(scheme, shape):
    """Without a loop: the state dict (names, order, values), the init's RNG consumption and the logits
    of the model before loops existed; and the logits equal, bit for bit, the forward pass as it was
    written then (embedding, stream start, every block in order, stream end, final norm, LM head)."""
    base = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)
    cfg = ModelConfig(**{**base, **REFERENCE_SHAPES[shape]}, residual=scheme)
    assert cfg.n_sublayers == 2 * cfg.n_layers and cfg.effective_layers == cfg.n_layers
    torch.manual_seed(1234)
    model = Transformer(cfg)
    next_draw = torch.randn(()).item()
    ids = torch.arange(2 * 9).reshape(2, 9) * 7 % 97
    with torch.no_grad():
        logits = model(ids)
        T = ids.shape[1]
        x = model.tok_emb(ids)
        x = model.stream.begin(x) if model.stream is not None else x
        for block in model.blocks:
            x = block(x, model.rope_cos[:T], model.rope_sin[:T], None)
        x = model.stream.end(x) if model.stream is not None else x
        x = model.norm(x) if model.norm is not None else x
        before = model.lm_head(x).float()
    got = (state_hash(model), next_draw, logits.double().sum().item(), logits.double().abs().sum().item())
    if f"{scheme}/{shape}" not in REFERENCE:  # a new scheme: its entry is recorded once, from its first code
        pytest.fail(f"no reference for a new scheme: add to REFERENCE in tests/test_loop.py\n    "
                    f"{f'{scheme}/{shape}'!r}: {got!r},")
    want_hash, want_draw, want_sum, want_abs = REFERENCE[f"{scheme}/{shape}"]
    assert state_hash(model) == want_hash
    assert next_draw == want_draw
    assert torch.equal(logits, before)
    assert logits.double().sum().item() == pytest.approx(want_sum, rel=1e-6, abs=1e-4)
    assert logits.double().abs().sum().item() == pytest.approx(want_abs, rel=1e-6)


# ---- refusals: one line each ---------------------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    (dict(n_layers=4, loop_prelude=2, loop_core=3), r"model.loop_prelude \(2\) \+ model.loop_core \(3\) exceeds "
                                                    r"model.n_layers \(4\)"),
    (dict(loop_repeats=3), "model.loop_repeats = 3 needs a loop: set model.loop_core >= 1"),
    (dict(loop_prelude=1), "model.loop_prelude = 1 needs a loop"),
    (dict(loop_sampling="uniform"), "model.loop_sampling = 'uniform' needs a loop"),
    (dict(loop_core=1, loop_repeats=0), "model.loop_repeats must be >= 1, got 0"),
    (dict(loop_core=-1), "model.loop_core must be >= 0"),
    (dict(loop_core=1, loop_sampling="geometric"), "model.loop_sampling must be"),
    (dict(residual="keel", loop_core=2), "model.loop_prelude = 0 puts Keel's first sub-layers"),
    (dict(residual="attn_res", loop_prelude=1, loop_core=2), "model.residual = attn_res cannot loop"),
])
def test_bad_loop_configs(kw, msg):
    cfg = ModelConfig(**{**dict(vocab_size=61, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, n_layers=4), **kw})
    with pytest.raises(KeelError, match=msg) as e:
        Transformer(cfg)
    assert "\n" not in str(e.value)


def test_bad_loop_counts():
    looped = Transformer(looped_cfg("pre_ln", 1, 2, 2, 1))
    plain = Transformer(dataclasses.replace(looped.cfg, **NO_LOOP))
    ids = torch.zeros(1, 3, dtype=torch.long)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(KeelError, match="the loop count must be an integer >= 1"):
            looped(ids, loops=bad)
        with pytest.raises(KeelError, match="the loop count must be an integer >= 1"):
            looped.set_loops(bad)
    with pytest.raises(KeelError, match=r"needs a looped model \(model.loop_core >= 1\)"):
        plain.set_loops(2)
    with pytest.raises(KeelError, match="needs a looped model"):
        plain(ids, loops=2)
    assert looped.loops == 2


def test_set_loops_none_goes_back_to_the_trained_count():
    """``set_loops(None)``: the core runs ``cfg.loop_repeats`` (2) times again, logits equal to a fresh model's; a
    model that does not loop accepts it too (nothing to restore). It was refused ('the loop count must be an
    integer >= 1')."""
    torch.manual_seed(0)
    looped = Transformer(looped_cfg("keel", 1, 2, 2, 1)).eval()
    ids = torch.randint(0, 61, (1, 5))
    with torch.no_grad():
        trained = looped(ids)
        looped.set_loops(5)
        assert looped.loops == 5 and len(looped.depth_order()) == 1 + 5 * 2 + 1
        assert not torch.allclose(looped(ids), trained)
        looped.set_loops(None)
        assert looped.loops == 2 and len(looped.depth_order()) == 1 + 2 * 2 + 1
        assert torch.equal(looped(ids), trained)
    plain = Transformer(dataclasses.replace(looped.cfg, **NO_LOOP))
    plain.set_loops(None)
    assert plain.loops == plain.cfg.loop_repeats == 1


# ---- test-time depth and the KV cache ------------------------------------------------------------

@pytest.mark.parametrize("scheme", LOOPING)
@pytest.mark.parametrize("shape", [(1, 2, 2, 1), (0, 1, 3, 0)], ids=lambda s: "P{}C{}R{}Q{}".format(*s))
def test_kv_cache_at_any_loop_count(scheme, shape):
    """Each core application at a position has its own keys and values: incremental decoding at a
    loop count equals the full forward pass at that count, and cached greedy generation equals
    uncached, at the trained count and at another, by argument or by set_loops."""
    torch.manual_seed(0)
    model = Transformer(looped_cfg(scheme, *shape)).eval()
    P, C, R, Q = shape
    ids = torch.randint(0, 61, (2, 12))
    assert not torch.allclose(model(ids, loops=1), model(ids, loops=2 * R))
    for r in (max(1, R // 2), 2 * R):  # R/2 and 2R
        full = model(ids, loops=r)
        cache = KVCache()
        parts = [model(ids[:, :5], cache=cache, loops=r), model(ids[:, 5:6], cache=cache, loops=r),
                 model(ids[:, 6:], cache=cache, loops=r)]
        assert len(cache.keys) == P + r * C + Q and cache.get_seq_length() == 12
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
        cached = model.generate(ids[:, :4], 6, temperature=0, use_cache=True, loops=r)
        assert torch.equal(cached, model.generate(ids[:, :4], 6, temperature=0, use_cache=False, loops=r))
    model.set_loops(2 * R)
    assert torch.equal(model.generate(ids[:, :4], 6, temperature=0), cached)
    assert torch.equal(model(ids), model(ids, loops=2 * R))


def test_left_padded_generation_of_a_looped_model():
    """A padded batch of prompts (the mask path of the cache) generates what each row does alone."""
    torch.manual_seed(0)
    model = Transformer(looped_cfg("keel", 1, 2, 3, 1)).eval()
    a, b = torch.randint(0, 61, (1, 6)), torch.randint(0, 61, (1, 3))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    out = model.generate(batch, 5, temperature=0, attention_mask=mask, loops=4)
    assert torch.equal(out[0, 6:], model.generate(a, 5, temperature=0, loops=4)[0, 6:])
    assert torch.equal(out[1, 6:], model.generate(b, 5, temperature=0, loops=4)[0, 3:])


def test_a_cache_filled_at_one_loop_count_refuses_another():
    """A cache holds one slot per applied block: one filled at R served the next token at R' silently (the
    coda read a core application's keys, the extra applications none), logits off by ~1e-3 at 2R and R/2.
    Refused in one line, before anything is appended; at its own count it goes on; HF's DynamicCache too."""
    torch.manual_seed(0)
    model = Transformer(looped_cfg("keel", 1, 2, 3, 1)).eval()
    ids = torch.randint(0, 61, (1, 8))
    caches = [KVCache()]
    if importlib.util.find_spec("transformers") is not None:
        from transformers import DynamicCache
        caches.append(DynamicCache())
    for cache in caches:
        model(ids[:, :5], cache=cache, loops=3)
        for other in (1, 2, 4, 6):
            with pytest.raises(KeelError, match=f"filled at 3 loops.*not at {other}") as e:
                model(ids[:, 5:6], cache=cache, loops=other)
            assert "\n" not in str(e.value) and cache.get_seq_length() == 5
        torch.testing.assert_close(model(ids[:, 5:], cache=cache, loops=3), model(ids, loops=3)[:, 5:],
                                   rtol=1e-5, atol=1e-5)


# ---- training-time depth ---------------------------------------------------------------------------

@pytest.mark.parametrize("R", [1, 2, 5])
def test_loop_count_distributions(R):
    """fixed: nothing drawn (None: the model's R); uniform: 1 .. 2R - 1; poisson_lognormal (Geiping et al.
    2025, Sec. 3.3): 1 + Poisson(e^tau), tau ~ N(log(R - 1) - 1/8, 1/4); both of mean R, and a pure function
    of (seed, step)."""
    def draws(sampling, seed=7, n=4000):
        cfg = ModelConfig(n_layers=2, loop_core=1, loop_repeats=R, loop_sampling=sampling)
        return [loop_count(cfg, seed, step) for step in range(n)]

    assert set(draws("fixed", n=50)) == {None}
    uniform = draws("uniform")
    assert set(uniform) == set(range(1, 2 * R))
    lognormal = draws("poisson_lognormal")
    assert min(lognormal) >= 1 and (R == 1) == (set(lognormal) == {1})
    for xs in (uniform, lognormal):
        sd = statistics.pstdev(xs)
        assert abs(statistics.mean(xs) - R) <= 4 * sd / math.sqrt(len(xs)) + 1e-9
    assert draws("poisson_lognormal", n=100) == draws("poisson_lognormal", n=100)
    if R > 1:
        assert draws("uniform", seed=8, n=100) != draws("uniform", seed=7, n=100)


@pytest.mark.parametrize("sampling", ["fixed", "uniform", "poisson_lognormal"])
def test_memory_check_sizes_a_looped_run_at_its_largest_loop_count(sampling, monkeypatch):
    """The memory check before training sizes a looped run's activations at the most core applications a
    step draws, not at the mean R (a run that fit at R ran out of memory at a step that drew more): R
    (fixed), 2R - 1 (uniform), and with poisson_lognormal, which has no largest, the largest of the run's
    own draws. A run that fits at R but not there is refused in one line naming the count."""
    from keel.config import TrainConfig
    from keel.train import device as DV

    R, steps, seed = 8, 500, 3
    cfg = looped_cfg("pre_ln", 1, 2, R, 1, loop_sampling=sampling)
    t = TrainConfig(batch_size=2, seq_len=16, steps=steps, seed=seed)
    drawn = [loop_count(cfg, seed, s) or R for s in range(steps)]
    largest = 2 * R - 1 if sampling == "uniform" else max(drawn)
    assert max(drawn) == largest  # uniform too: 500 steps reach 2R - 1
    assert largest_loop_count(cfg, seed, steps) == largest and (sampling == "fixed") == (largest == R)
    assert largest_loop_count(dataclasses.replace(cfg, n_layers=2, **NO_LOOP), seed, steps) == 1

    def unrolled(r):  # the floor of the same blocks unrolled, the core applied r times
        return DV.activation_floor_bytes(dataclasses.replace(cfg, n_layers=2 + 2 * r, **NO_LOOP), t)

    assert DV.activation_floor_bytes(cfg, t) == unrolled(largest)
    monkeypatch.setattr(DV, "host_memory_bytes", lambda: count_parameters(cfg) * 16 + unrolled(R))
    if sampling == "fixed":
        DV.check_activations_fit(cfg, t)
        return
    with pytest.raises(KeelError, match=f"on {2 * (2 + 2 * largest)} sub-layers \\(the core applied {largest} times, "
                                        f"the most a step draws with model.loop_sampling {sampling}\\)") as e:
        DV.check_activations_fit(cfg, t)
    assert "\n" not in str(e.value)


def test_activation_checkpointing_per_application():
    """Per-block activation checkpointing recomputes each application of a core block on its own
    (one forward plus one recomputation per application), with the gradients of the plain model."""
    cfg = looped_cfg("keel", 1, 2, 3, 1)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, "block") == [0, 1, 2, 3]
    calls = []
    ckpt.blocks[1].attn.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 61, (2, 8))
    plain(ids, torch.roll(ids, -1, 1)).backward()
    ckpt(ids, torch.roll(ids, -1, 1)).backward()
    assert len(calls) == 2 * 3
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name


# ---- diagnostics per applied sub-layer: gradflow, ablate -----------------------------------------------

@pytest.mark.parametrize("share_weights", [True, False])
def test_unrolled_model_is_the_looped_one(share_weights):
    """Transformer.unrolled: the unlooped model of the applied blocks, logits equal at R and at another count;
    sharing the weights (no new parameter) or with copies of them (a parameter set per application)."""
    torch.manual_seed(0)
    model = perturbed(Transformer(looped_cfg("keel", 1, 2, 3, 1)))
    ids = torch.randint(0, 61, (2, 9))
    for r in (3, 5):
        flat = model.unrolled(r, share_weights=share_weights)
        assert len(flat.blocks) == 1 + 2 * r + 1 and not flat.cfg.loop_core and flat.cfg.n_sublayers == 2 * (2 + 2 * r)
        assert torch.equal(flat(ids), model(ids, loops=r))
        ids_of = {id(p) for p in model.parameters()}
        assert all((id(p) in ids_of) == share_weights for p in flat.blocks.parameters())
    with pytest.raises(KeelError, match="the loop count must be an integer >= 1"):
        model.unrolled(0)


@pytest.mark.parametrize("scheme", ["keel", "pre_ln", "mhc"])
def test_gradflow_per_applied_sublayer(scheme):
    """keel gradflow of a looped model: one entry per applied sub-layer, 2 (P + R C + Q); the stream gradient
    after each application (hooks on the looped model's shared units, in call order), the parameter gradient
    of each application (its copy in the unrolled model of copies), J* of each application's own input."""
    P, C, R, Q = 1, 2, 3, 1
    torch.manual_seed(0)
    model = perturbed(Transformer(looped_cfg(scheme, P, C, R, Q)).to(torch.float64))
    batch = torch.randint(0, 61, (2, 10))
    prof = profile_model(model, batch, jacobian_iters=4)
    order = order_from_definition(P, C, R, Q)
    assert prof["weight_sublayer"] == [2 * b + k for b in order for k in (0, 1)]
    assert prof["loop"] == {"prelude": 1, "core": 2, "coda": 1, "repeats": 3, "trained_repeats": 3}
    outs = []  # the definition of the stream gradient: after each call of a unit, in order
    hooks = [unit.register_forward_hook(lambda m, a, out: (out.retain_grad(), outs.append(out))[-1] and None)
             for _, unit, _ in model.sublayers()]
    loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    for h in hooks:
        h.remove()
    assert len(outs) == 2 * len(order) == len(prof["jacobian_star"]) == len(prof["param_grad_norm"])
    assert prof["loss"] == pytest.approx(loss.item(), rel=1e-12)
    assert prof["stream_grad_norm"] == pytest.approx([o.grad.norm().item() for o in outs], rel=1e-9)
    flat = unrolled_copies(model, order)
    flat(batch[:, :-1], batch[:, 1:]).backward()
    per_application = [math.sqrt(sum(p.grad.pow(2).sum().item() for m in (f, unit) for p in m.parameters()))
                       for _, unit, f in flat.sublayers()]
    assert prof["param_grad_norm"] == pytest.approx(per_application, rel=1e-9)
    if scheme == "pre_ln":  # x + F(Norm(x)): the identity on the residual path
        assert prof["jacobian_star"] == pytest.approx([1.0] * len(outs), rel=1e-9)
    else:  # each application has its own input: the J* of a core sub-layer differ between applications
        core = [j for j, w in zip(prof["jacobian_star"], prof["weight_sublayer"]) if w == 2 * P]
        assert len(core) == R and len(set(core)) == R


def test_ablate_removes_one_application_at_a_time():
    """keel ablate of a looped model: unit i is the i-th applied sub-layer; removing it equals bypassing that
    application only (the shared unit's call number a mod R in each pass) and keeping the others."""
    P, C, R, Q = 1, 2, 3, 1
    torch.manual_seed(0)
    model = perturbed(Transformer(looped_cfg("keel", P, C, R, Q)))
    windows = torch.randint(0, 61, (3, 9))
    res = ablate_model(model, windows, batch_size=2)
    order = order_from_definition(P, C, R, Q)
    assert [u["weight_sublayer"] for u in res["units"]] == [2 * b + k for b in order for k in (0, 1)]
    assert [u["application"] for u in res["units"][::2]] == [None] + [a for a in range(R) for _ in range(C)] + [None]
    assert (res["sublayers"], res["loop"]["repeats"]) == (2 * len(order), R)
    # "blocks" are blocks of weights, as in keel eval's report; it counted applied blocks (14 for 10 + 4)
    assert (res["blocks"], res["applied_blocks"]) == (P + C + Q, len(order))
    assert f"keel, 4 blocks of weights, {len(order)} applied = {2 * len(order)} sub-layers;" in ablate_markdown(res, "t")
    cpu = torch.device("cpu")
    assert res["nll_full"] == pytest.approx(mean_nll(model, windows, 2, cpu), rel=1e-6)
    units = [unit for _, unit, _ in model.sublayers()]
    for u in res["units"]:
        unit, calls = units[u["weight_sublayer"]], iter(range(10**6))
        original = unit.forward

        def bypass_one(x, f, unit=unit, calls=calls, original=original, a=u["application"]):
            return unit.removed(x) if a is None or next(calls) % R == a else original(x, f)

        unit.forward = bypass_one
        try:
            assert u["nll"] == pytest.approx(mean_nll(model, windows, 2, cpu), rel=1e-6), u
        finally:
            del unit.forward
    core = [u["nll"] for u in res["units"] if u["weight_sublayer"] == 2 * P]
    assert len(core) == R and len(set(core)) == R


@pytest.mark.parametrize("args,msg", [
    (["--loop", "1,2,1", "--sublayers", "8,10"], "--loop 1,2,1: 10 sub-layers is not 2 (P + R C + Q) = 2 (1 + R x 2 + 1) "
                                                 "for an integer R >= 1 (e.g. 8, 12)"),
    (["--loop", "1,2,1", "--sublayers", "4"], "--loop 1,2,1: 4 sub-layers is not 2 (P + R C + Q)"),
    (["--loop", "1,0,1"], "--loop 1,0,1: the prelude and coda need >= 0 blocks and the core >= 1"),
    (["--loop", "1,8"], "--loop takes P,C,Q: the blocks of prelude, core and coda (e.g. 1,8,1), got '1,8'"),
    (["--residual", "keel", "--loop", "0,2,0", "--sublayers", "8"], "model.loop_prelude = 0 puts Keel's first"),
    (["--residual", "attn_res", "--loop", "1,2,1", "--sublayers", "8"], "model.residual = attn_res cannot loop"),
    (["--loops", "2"], "--loops goes with --run (a looped run's count); at init, --loop P,C,Q and --sublayers set it"),
    (["--run", "x", "--loop", "1,1,1"], "--run takes the model and data from the run; drop --residual, --loop"),
    # the config's own loop keys: they profiled a model of 16 sub-layers, reported as 8 (blocks 4); beside --loop
    # they were dropped without a word
    (["--sublayers", "8", "--set", "model.loop_prelude=1", "--set", "model.loop_core=2", "--set", "model.loop_repeats=3"],
     "the config's model.loop_prelude = 1, model.loop_core = 2, model.loop_repeats = 3 make a model of 8 sub-layers "
     "apply 16 (2 (P + R C + Q) = 2 (1 + 3 x 2 + 1)); to profile looped models at init, give --loop P,C,Q and the "
     "effective depths as --sublayers"),
    # a fresh-user trial: the shape keys each profile sets were dropped without a word (d_model 32 in the table)
    (["--loop", "1,2,1", "--sublayers", "12", "--set", "model.n_layers=3"],
     "--set model.n_layers: at init each profile's shape comes from --sublayers (heads of 32, d_ff = 3 d_model); "
     "give --sublayers instead"),
    (["--sublayers", "8", "--set", "model.d_model=48", "--set", "model.d_ff=96"],
     "--set model.d_model, model.d_ff: at init each profile's shape comes from --d-model (heads of 32, d_ff = 3 "
     "d_model); give --d-model instead"),
    (["--sublayers", "8", "--set", "model.residual=keel", "--set", "model.n_layers=2"],
     "--set model.residual, model.n_layers: at init each profile's shape comes from --residual and --sublayers"),
    (["--loop", "1,2,1", "--sublayers", "8", "--set", "model.loop_core=3"],
     "--loop 1,2,1 sets every profile's loop (R from --sublayers; no count is sampled at init); drop --set "
     "model.loop_core"),
    # a fresh-user trial: these were refused as "model.loop_repeats = 4 needs a loop: set model.loop_core >= 1"
    (["--loop", "1,2,1", "--sublayers", "12", "--set", "model.loop_repeats=4", "--set", "model.loop_sampling=uniform"],
     "--loop 1,2,1 sets every profile's loop (R from --sublayers; no count is sampled at init); drop --set "
     "model.loop_repeats, model.loop_sampling"),
    # and without --sublayers: "16 sub-layers is not 2 (P + R C + Q)", the default depths it did not name
    (["--loop", "1,8,1"], "--loop 1,8,1 needs --sublayers, the effective depths 2 (P + R C + Q) to profile "
                          "(e.g. 20,68,260)"),
])
def test_gradflow_loop_flags_are_checked_first(keel_main, args, msg):
    """Refused in one line before any data is prepared or model built."""
    r = keel_main("gradflow", "--residual", "pre_ln", *args)
    assert r.returncode == 2 and r.stderr.startswith("keel: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert msg in r.stderr


@pytest.mark.parametrize("args", [["--loop", "-1,8,1"], ["--loop=-1,8,1"], ["--loop", "-1,8,1", "--sublayers", "20"]])
def test_gradflow_loop_with_a_negative_first_value_reaches_keels_check(keel_main, args):
    """``--loop -1,8,1``: keel's own one-line message on the prelude, as ``--loop 1,0,1`` gets. argparse took
    '-1,8,1' for an option ('argument --loop: expected one argument', with the usage)."""
    r = keel_main("gradflow", "--residual", "pre_ln", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr == "keel: error: --loop -1,8,1: the prelude and coda need >= 0 blocks and the core >= 1\n"


# ---- checkpoints: shared weights once ----------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["keel", "mhc"])
def test_save_load_round_trip(scheme, tmp_path):
    cfg = looped_cfg(scheme, 1, 2, 3, 1)
    torch.manual_seed(0)
    model = perturbed(Transformer(cfg)).eval()
    ckpt = CheckpointManager(tmp_path).save(1, model, {"step": 1})
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert stored == set(model.state_dict()) == set(Transformer(dataclasses.replace(cfg, **NO_LOOP)).state_dict())
    assert not any(k.startswith(f"blocks.{cfg.n_layers}.") for k in stored)  # n_layers blocks, not P + R C + Q
    torch.manual_seed(1)
    loaded = Transformer(cfg).eval()
    CheckpointManager.load_weights(loaded, ckpt)
    ids = torch.randint(0, 61, (2, 9))
    for r in (None, 5):
        assert torch.equal(loaded(ids, loops=r), model(ids, loops=r))


# ---- end to end: keel train, resume ------------------------------------------------------------------

LOOP_SETS = ["model.n_layers=3", "model.loop_prelude=1", "model.loop_core=1", "model.loop_repeats=3"]


def test_keel_train_and_generate_looped(keel_main, tiny_data, tmp_path):
    run = tmp_path / "looped"
    sets = tiny_overrides(tiny_data, steps=4, eval_every=2, checkpoint_every=2) + LOOP_SETS + \
        ["model.loop_sampling=uniform"]
    r = keel_main("train", "--run-dir", run, *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stderr
    assert "validation loss at step 4" in r.stdout
    assert "3 blocks, looped: 1 + 1 x 3 + 1 = 10 sub-layers, d_model" in r.stderr  # was "3 blocks = 10 sub-layers"
    cfg = Run(run).config
    assert (cfg.model.loop_core, cfg.model.loop_repeats, cfg.model.n_sublayers) == (1, 3, 10)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [rec for rec in recs if rec["step"] > 0]
    assert [rec["loops"] for rec in steps] == [loop_count(cfg.model, cfg.train.seed, s) for s in range(4)]
    assert all(1 <= rec["loops"] <= 5 and math.isfinite(rec["loss"]) for rec in steps)
    model = Run(run).load_model()
    assert model.loops == 3 and len(model.blocks) == 3
    r = keel_main("generate", "--run", run, "--prompt", "import os", "--max-new-tokens", "5", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("import os")
    # test-time depth: --loops at 2R and below R, as the model set to that count computes it
    tokenizer, windows = Run(run).tokenizer(), validation_tokens(Run(run).data_dir(), 32, 1024)
    for loops in (6, 1):
        model.set_loops(loops)
        r = keel_main("generate", "--run", run, "--prompt", "import os", "--max-new-tokens", "5", "--temperature", "0",
                      "--loops", loops)
        assert r.returncode == 0, r.stderr
        assert r.stdout == sample_text(model, tokenizer, "import os", 5, torch.device("cpu"), temperature=0) + "\n"
        r = keel_main("eval", "--run", run, "--loops", loops, "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["sublayers"] == 2 * (1 + loops + 1) and report["loop"]["repeats"] == loops
        assert (report["blocks"], report["applied_blocks"]) == (3, 1 + loops + 1)
        assert report["loop"]["trained_repeats"] == 3
        assert report["perplexity"]["loss"] == pytest.approx(mean_nll(model, windows, 8, torch.device("cpu")), rel=1e-6)
    r = keel_main("eval", "--run", run, "--loops", 6)
    assert "3 blocks, looped: 1 + 1 x 6 + 1, trained at 3 = 16 sub-layers" in r.stdout
    for command in ("eval", "generate", "ablate"):
        r = keel_main(command, "--run", run, "--loops", 0)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == ["keel: error: --loops must be >= 1, got 0"]
    # the diagnostics per applied sub-layer, at another count
    r = keel_main("ablate", "--run", run, "--loops", 2, "--tokens", 256, "--json", "--out", tmp_path / "ablate")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert [u["application"] for u in res["units"]] == [None, None, 0, 0, 1, 1, None, None]
    assert (res["blocks"], res["applied_blocks"], res["sublayers"]) == (3, 4, 8)  # as keel eval's report counts
    assert "| index | block | unit | weights | application |" in (tmp_path / "ablate" / "ablate.md").read_text()
    gradflow = ("--json", "--seq-len", 16, "--batch-size", 1, "--jacobian-iters", 2)
    r = keel_main("gradflow", "--run", run, "--loops", 5, *gradflow)
    assert r.returncode == 0, r.stderr
    (res,) = json.loads(r.stdout)["results"]
    assert res["sublayers"] == 2 * (1 + 5 + 1) == len(res["jacobian_star"]) and res["loop"]["repeats"] == 5
    assert (res["blocks"], res["applied_blocks"]) == (3, 7)
    r = keel_main("gradflow", "--residual", "keel,pre_ln", "--loop", "1,1,1", "--sublayers", "6,10", "--d-model", 16,
                  "--set", f"data.path={tiny_data}", "--set", "model.vocab_size=512", *gradflow)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)["results"]
    assert [(x["residual"], x["sublayers"], x["loop"]["repeats"], len(x["stream_grad_norm"])) for x in results] == \
        [("keel", 6, 1, 6), ("pre_ln", 6, 1, 6), ("keel", 10, 3, 10), ("pre_ln", 10, 3, 10)]
    assert [(x["blocks"], x["applied_blocks"]) for x in results] == [(3, 3), (3, 3), (3, 5), (3, 5)]


def test_gradflow_loop_without_residual_profiles_every_scheme_that_loops(keel_main, tiny_data):
    """The default --residual (every scheme) with --loop was refused as a whole, "attn_res cannot loop"."""
    r = keel_main("gradflow", "--loop", "1,1,1", "--sublayers", "6", "--d-model", 16, "--set", f"data.path={tiny_data}",
                  "--set", "model.vocab_size=512", "--json", "--seq-len", 16, "--batch-size", 1, "--jacobian-iters", 2)
    assert r.returncode == 0, r.stderr
    assert sorted(x["residual"] for x in json.loads(r.stdout)["results"]) == LOOPING
    assert keel_main("gradflow", "--residual", "attn_res", "--loop", "1,1,1", "--sublayers", "6").returncode == 2


def test_gradflow_loop_without_residual_leaves_out_keel_at_a_prelude_of_0(keel_main, tiny_data):
    """``--loop 0,1,0`` without --residual failed as a whole on Keel's first-sub-layer rule ("model.loop_prelude =
    0 puts Keel's first sub-layers ..."): every other scheme that loops is profiled, and the log names why Keel
    and attn_res are not."""
    r = keel_main("gradflow", "--loop", "0,1,0", "--sublayers", "4", "--d-model", 16, "--set", f"data.path={tiny_data}",
                  "--set", "model.vocab_size=512", "--json", "--seq-len", 16, "--batch-size", 1, "--jacobian-iters", 2)
    assert r.returncode == 0, r.stderr
    assert sorted(x["residual"] for x in json.loads(r.stdout)["results"]) == sorted(set(LOOPING) - {"keel"})
    assert "gradflow --loop 0,1,0: not profiling keel (model.loop_prelude = 0 puts Keel's first" in r.stderr
    assert "gradflow --loop 0,1,0: not profiling attn_res (model.residual = attn_res cannot loop" in r.stderr


@pytest.mark.parametrize("command", ["stress", "lr-sensitivity"])
def test_a_depth_grid_refuses_loop_sets_that_change_the_depth_it_names(keel_main, tmp_path, command):
    """--sublayers L sets model.n_layers = L/2, so with a loop of R > 1 set the runs applied more sub-layers
    than their names and tables said (16 in the plan's sub-layers, 24 in its tokens per parameter)."""
    loop = ["--set", "model.loop_prelude=1", "--set", "model.loop_core=2"]
    args = [command, "--residual", "keel", "--sublayers", "16", *loop, "--dry-run"]
    r = keel_main(*args, "--set", "model.loop_repeats=3", "--out", tmp_path / "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "x").exists(), r.stderr
    assert "runs of 16 sub-layers apply 24" in r.stderr and "loop = [P, C, Q]" in r.stderr
    assert keel_main(*args, "--out", tmp_path / "y").returncode == 0  # R = 1: 2 (P + C + Q) = 2 n_layers


@pytest.mark.parametrize("command", ["eval", "generate", "ablate"])
def test_loops_flag_refuses_a_model_that_does_not_loop(keel_main, tiny_reference_run, command):
    r = keel_main(command, "--run", tiny_reference_run, "--loops", 2)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == \
        [f"keel: error: --loops needs a looped model (model.loop_core >= 1); {tiny_reference_run} does not loop"]


def test_exact_resume_of_a_looped_run(tiny_data, tmp_path, monkeypatch):
    """A run at a random loop count per step, interrupted and resumed, draws the same counts and
    logs the same losses as the uninterrupted run, and ends with the same weights."""
    def config():
        sets = tiny_overrides(tiny_data) + LOOP_SETS + ["model.loop_sampling=poisson_lognormal", "model.residual=pre_ln"]
        return load_config(REPO / "keel" / "configs" / "demo.toml", sets)

    full, part = tmp_path / "full", tmp_path / "part"
    train(config(), full)
    calls, original = {"n": 0}, TokenLoader.next_batch

    def crash_at_step_10(self):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(TokenLoader, "next_batch", crash_at_step_10)
    with pytest.raises(KeyboardInterrupt):
        train(config(), part)
    monkeypatch.setattr(TokenLoader, "next_batch", original)
    assert CheckpointManager(part).latest().name == "step_00000008"
    train(config(), part, resume=True)

    def metrics(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    assert len({r["loops"] for r in a if "loops" in r}) > 1
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "lr", "val_loss", "tokens", "loops"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    wa, wb = Run(full).load_model().state_dict(), Run(part).load_model().state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    if importlib.util.find_spec("transformers"):  # a looped pre_ln run exports as keel, not as a stock Llama
        from transformers import AutoModelForCausalLM

        from keel.hf.convert import export_hf

        out = export_hf(full, tmp_path / "hf")
        exported = json.loads((out / "config.json").read_text())
        assert exported["model_type"] == "keel" and exported["loops"] is None
        assert [exported[k] for k in ("loop_prelude", "loop_core", "loop_repeats", "loop_sampling")] == \
            [1, 1, 3, "poisson_lognormal"]
        ids, native = torch.randint(0, 512, (1, 20)), Run(full).load_model()
        with torch.no_grad():  # the export round trip at the trained count and at 2R
            for r in (None, 6):
                torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out, loops=r)(ids).logits,
                                           native(ids, loops=r), atol=1e-5, rtol=0)



class _CoreCalls(Callback):
    """Counts, per training step, the grad-enabled calls of the core block's attention (block 1 of LOOP_SETS'
    P = C = Q = 1): one per application, two where the application is checkpointed (forward + recomputation)."""

    def __init__(self):
        self.per_step, self.n = [], 0

    def on_train_start(self, state):
        def count(*_):
            self.n += torch.is_grad_enabled()
        state.model.blocks[1].attn.register_forward_pre_hook(count)

    def on_gradients(self, state):
        self.per_step.append(self.n)
        self.n = 0


def test_checkpoint_min_loops_recomputes_only_the_steps_that_draw_that_many(tiny_data, tmp_path):
    """train.activation_checkpoint_min_loops = n: a step that draws at least n core applications recomputes
    each of them in the backward, a step that draws fewer keeps its activations; the losses, gradient norms and
    final weights are those of the run without checkpointing and of the run that checkpoints every step."""
    base = tiny_overrides(tiny_data, steps=12) + LOOP_SETS + ["model.loop_sampling=uniform"]  # R = 3: 1 .. 5
    runs = {}
    for name, sets in [("none", []), ("block", ["train.activation_checkpointing=block"]),
                       ("min3", ["train.activation_checkpointing=block", "train.activation_checkpoint_min_loops=3"])]:
        calls = _CoreCalls()
        train(load_config(REPO / "keel" / "configs" / "demo.toml", base + sets), tmp_path / name, callbacks=[calls])
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r for r in records if "loss" in r], calls.per_step, Run(tmp_path / name).load_model())
    loops = [r["loops"] for r in runs["none"][0]]
    assert min(loops) < 3 <= max(loops)  # the draws fall on both sides of n
    assert runs["none"][1] == loops and runs["block"][1] == [2 * r for r in loops]
    assert runs["min3"][1] == [2 * r if r >= 3 else r for r in loops]
    for name in ("block", "min3"):
        assert [(r["loss"], r["grad_norm"], r["loops"]) for r in runs[name][0]] == \
            [(r["loss"], r["grad_norm"], r["loops"]) for r in runs["none"][0]]
        want, got = runs["none"][2].state_dict(), runs[name][2].state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want), name


@pytest.mark.parametrize("sampling, n", [("uniform", 6), ("uniform", 4), ("fixed", 3), ("fixed", 4), ("uniform", 0)])
def test_the_run_header_says_which_steps_checkpoint(sampling, n):
    """A fresh-user trial: min_loops above every count a run draws (6 with uniform at R = 3: 1 .. 5; 4 with fixed
    R = 3) checkpointed no step while the header said "activation checkpointing: block"; it now says how many."""
    from keel.train.trainer import checkpoint_min_loops_words

    cfg = load_config(REPO / "keel" / "configs" / "demo.toml", LOOP_SETS + [
        f"model.loop_sampling={sampling}", "train.steps=30", "train.activation_checkpointing=block",
        f"train.activation_checkpoint_min_loops={n}"])
    counts = [loop_count(cfg.model, cfg.train.seed, s) or 3 for s in range(30)]
    hit = sum(c >= n for c in counts)
    want = "" if n == 0 else f" on steps that draw >= {n} core applications (" + (
        f"{hit} of its 30 steps)" if hit else f"none of its 30 steps: they draw at most {max(counts)})")
    assert checkpoint_min_loops_words(cfg) == want
    assert (hit == 0) == ((sampling, n) in {("uniform", 6), ("fixed", 4)}) or n == 0


@pytest.mark.parametrize("sets, words", [
    (["train.activation_checkpointing=block", "model.loop_core=0", "model.loop_prelude=0", "model.loop_repeats=1"],
     "needs a looped model (model.loop_core > 0)"),
    ([], "has nothing to switch with train.activation_checkpointing = none"),
    (["train.activation_checkpointing=block", "train.compile=true"], "is not supported with train.compile"),
])
def test_checkpoint_min_loops_without_what_it_selects_on_is_refused(keel_main, tiny_data, tmp_path, sets, words):
    r = keel_main("train", *[a for s in tiny_overrides(tiny_data) + LOOP_SETS + sets
                             + ["train.activation_checkpoint_min_loops=3"] for a in ("--set", s)],
                  "--run-dir", tmp_path / "run")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"keel: error: train.activation_checkpoint_min_loops = 3 {words}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("mode, n, advice", [("none", 0, "or set train.activation_checkpointing"),
                                              ("block", 4, "or lower train.activation_checkpoint_min_loops"),
                                              ("block", 0, "or train a smaller model")])
def test_the_memory_refusal_advises_a_key_not_yet_set(monkeypatch, mode, n, advice):
    """A fresh-user trial: with train.activation_checkpointing = block already set, the refusal still said
    "set train.activation_checkpointing"."""
    from keel.config import TrainConfig
    from keel.train import device as DV

    cfg = looped_cfg("pre_ln", 1, 2, 8, 1, loop_sampling="uniform")
    t = TrainConfig(batch_size=2, seq_len=16, steps=50, activation_checkpointing=mode, activation_checkpoint_min_loops=n)
    monkeypatch.setattr(DV, "host_memory_bytes", lambda: count_parameters(cfg) * 16 + DV.rope_table_bytes(cfg) + 1)
    with pytest.raises(KeelError) as e:
        DV.check_activations_fit(cfg, t)
    assert str(e.value).endswith("lower the batch or sequence length, " + advice) and "\n" not in str(e.value)


def test_memory_floor_with_checkpoint_min_loops():
    """The floor of a step that draws fewer than n applications is the plain floor (every block's saved
    inputs, 4 d + 2 d_ff values per token and block); at n and above, one input (d values) per block; the run's
    floor is the larger of the plain one at min(largest, n - 1) and the checkpointed one at its largest."""
    from keel.config import TrainConfig
    from keel.train import device as DV

    cfg = looped_cfg("pre_ln", 1, 2, 8, 1, loop_sampling="uniform")  # largest draw 2R - 1 = 15
    d, ff, tokens, rope = cfg.d_model, cfg.d_ff, 2 * 16, DV.rope_table_bytes(cfg)

    def blocks(r):  # P + r C + Q
        return 1 + 2 * r + 1

    for n, want in [(0, blocks(15) * d), (4, max(blocks(15) * d, blocks(3) * (4 * d + 2 * ff))),
                    (100, blocks(15) * (4 * d + 2 * ff)), (1, blocks(15) * d)]:
        t = TrainConfig(batch_size=2, seq_len=16, steps=500, activation_checkpointing="block",
                        activation_checkpoint_min_loops=n)
        assert DV.activation_floor_bytes(cfg, t) == rope + tokens * want * 4, n
    assert blocks(3) * (4 * d + 2 * ff) > blocks(15) * d  # the n = 4 case is the plain floor's


def test_flops_per_token_at_a_loop_count():
    """``loops`` prices the unrolled model of P + loops x C + Q blocks; None is R (``loop_repeats``)."""
    cfg = looped_cfg("pre_ln", 1, 2, 3, 1)
    for k in (1, 3, 7):
        unrolled = dataclasses.replace(cfg, n_layers=1 + k * 2 + 1, **NO_LOOP)
        assert flops_per_token(cfg, 16, loops=k) == flops_per_token(unrolled, 16)
    assert flops_per_token(cfg, 16, loops=None) == flops_per_token(cfg, 16)
    assert flops_per_token(cfg, 16, loops=1) < flops_per_token(cfg, 16) < flops_per_token(cfg, 16, loops=7)


@pytest.mark.parametrize("kw, words", [
    (dict(loop_prelude=1, loop_core=5, loop_repeats=2),
     "model.loop_prelude (1) + model.loop_core (5) exceeds model.n_layers (4)"),
    (dict(loop_prelude=2, loop_core=0), "model.loop_prelude = 2 needs a loop"),
    (dict(loop_prelude=1, loop_core=2, loop_repeats=0), "model.loop_repeats must be >= 1, got 0"),
    (dict(loop_prelude=1, loop_core=2, loop_repeats=2, loop_sampling="often"), "model.loop_sampling must be"),
    (dict(residual="attn_res", loop_prelude=1, loop_core=2, loop_repeats=2), "attn_res cannot loop"),
])
def test_counts_of_an_impossible_loop_are_refused(kw, words):
    """count_parameters and flops_per_token (a study's plan, the trainer's MFU) priced a config no model can
    be built from: P + C > n_layers gave 70,112 parameters and the FLOPs of 4 + (2 - 1) x 5 = 9 blocks."""
    cfg = ModelConfig(**{**dict(vocab_size=61, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, n_layers=4), **kw})
    with pytest.raises(KeelError) as built:
        Transformer(cfg)
    for count in (lambda: count_parameters(cfg), lambda: count_parameters(cfg, non_embedding=True),
                  lambda: flops_per_token(cfg, 16)):
        with pytest.raises(KeelError) as e:
            count()
        assert words in str(e.value) and str(e.value) == str(built.value)


@pytest.mark.parametrize("loops, words", [(0, "got 0"), (-1, "got -1"), (2.5, "got 2.5"), (True, "got True")])
def test_flops_per_token_refuses_a_loop_count_no_model_runs(loops, words):
    cfg = looped_cfg("pre_ln", 1, 2, 3, 1)
    with pytest.raises(KeelError, match="the loop count must be an integer >= 1, " + words):
        flops_per_token(cfg, 16, loops=loops)
    with pytest.raises(KeelError, match="a loop count needs a looped model"):
        flops_per_token(dataclasses.replace(cfg, **NO_LOOP, n_layers=4), 16, loops=2)


def test_mfu_of_a_step_prices_the_loop_count_it_drew(tiny_data, tmp_path):
    """With a sampled loop count, a step's ``mfu`` is tokens/s x the FLOPs per token at the count that
    step ran (its ``loops``), not at the mean R: a step of 1 application does a third of R = 3's work."""
    sets = tiny_overrides(tiny_data, steps=8, peak_tflops=0.5) + LOOP_SETS + ["model.loop_sampling=uniform"]
    cfg = load_config(REPO / "keel" / "configs" / "demo.toml", sets)
    train(cfg, tmp_path / "run")
    model = load_config(tmp_path / "run" / "config.toml").model
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert len({r["loops"] for r in steps}) > 1
    for r in steps:
        unrolled = dataclasses.replace(model, n_layers=1 + r["loops"] + 1, **NO_LOOP)  # P = C = Q = 1
        fpt = flops_per_token(unrolled, cfg.train.seq_len)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / 0.5e12, rel=1e-12), r


@pytest.mark.spawns
def test_fsdp_and_ddp_of_a_looped_run_match_one_process(tiny_data, tmp_path):
    """Two processes (gloo) with a random loop count per step: FSDP2 (each block sharded once, the core's
    gathered at each application) and DDP follow the one-process run's counts, losses and gradient norms,
    and checkpoint the shared weights once."""
    def config(**train_keys):
        sets = tiny_overrides(tiny_data, steps=4, eval_every=4, checkpoint_every=4, **train_keys) + LOOP_SETS + \
            ["model.loop_sampling=uniform"]
        return load_config(REPO / "keel" / "configs" / "demo.toml", sets)

    spawn_training([(config(parallelism=p), tmp_path / p, False) for p in ("fsdp", "ddp")], world_size=2)
    train(config(), tmp_path / "single")

    def metrics(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    one, weights = metrics("single"), Run(tmp_path / "single").load_model().state_dict()
    assert len({r["loops"] for r in one if "loops" in r}) > 1
    for name in ("fsdp", "ddp"):
        two = metrics(name)
        assert [r.get("loops") for r in two] == [r.get("loops") for r in one]
        for a, b in zip(one, two):
            for key in ("loss", "grad_norm", "val_loss"):
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-5), (name, a["step"], key)
        got = Run(tmp_path / name).load_model().state_dict()  # a strict load: the n_layers blocks of weights
        assert set(got) == set(weights)
        for k in weights:
            torch.testing.assert_close(got[k], weights[k], rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("offline_one_thread")
@pytest.mark.parametrize("scheme", ["keel", "mhc", "pre_ln"])
def test_hugging_face_wrapper_of_a_looped_model(scheme, tmp_path):
    """keel.hf: the logits and greedy generation (transformers' own cache, made for n_layers blocks)
    of the native model at two loop counts, through the generated code too; no stock Llama."""
    pytest.importorskip("transformers")
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from keel.hf import KeelConfig, KeelForCausalLM
    from keel.hf.llama import to_llama
    from keel.hf.remote import write_remote_code

    torch.manual_seed(0)
    native = perturbed(Transformer(looped_cfg(scheme, 1, 2, 3, 1, max_seq_len=14))).eval()
    hf = KeelForCausalLM.from_native(native).eval()
    ids = torch.randint(0, 61, (2, 10))
    for r in (3, 5):
        hf.config.loops = r
        with torch.no_grad():
            assert torch.equal(hf(ids).logits, native(ids, loops=r))
        cached = hf.generate(ids[:, :4], max_new_tokens=12, do_sample=False, use_cache=True)  # past max_seq_len
        assert torch.equal(cached, hf.generate(ids[:, :4], max_new_tokens=12, do_sample=False, use_cache=False))
        assert torch.equal(cached, native.generate(ids[:, :4], 12, temperature=0, loops=r))
    hf.config.loops = None
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, native(ids, loops=3)) and native.loops == 3
    native.set_loops(5)  # wrapped at a count set at test time (keel eval --loops): the wrapper runs at it
    assert KeelForCausalLM.from_native(native).config.loops == 5
    native.set_loops(3)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["loops"] is None
    cls = get_class_from_dynamic_module(write_remote_code(tmp_path)["AutoModelForCausalLM"], str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(cls.from_pretrained(tmp_path).eval()(ids).logits, native(ids), atol=1e-5, rtol=0)
        for r in (6, 1):  # the config key `loops`: 2R and below R, through keel's code and the generated code
            for loaded in (KeelForCausalLM.from_pretrained(tmp_path, loops=r), cls.from_pretrained(tmp_path, loops=r)):
                assert loaded.config.loops == r and loaded.config.loop_repeats == 3
                torch.testing.assert_close(loaded.eval()(ids).logits, native(ids, loops=r), atol=1e-5, rtol=0)
        loaded = KeelForCausalLM.from_pretrained(tmp_path).eval()
        loaded.config.loops = 6  # set after loading: the next forward runs at it
        torch.testing.assert_close(loaded(ids).logits, native(ids, loops=6), atol=1e-5, rtol=0)
        cached = loaded.generate(ids[:, :4], max_new_tokens=6, do_sample=False, use_cache=True)
        assert torch.equal(cached, native.generate(ids[:, :4], 6, temperature=0, loops=6))
        for loaded in (KeelForCausalLM.from_pretrained(tmp_path, loops=6), cls.from_pretrained(tmp_path, loops=6)):
            loaded.eval().config.loops = None  # back to the trained R = 3: it kept running at 6, and saved as
            torch.testing.assert_close(loaded(ids).logits, native(ids), atol=1e-5, rtol=0)  # null it reloaded at 3
            loaded.save_pretrained(tmp_path / "again")
            assert json.loads((tmp_path / "again" / "config.json").read_text())["loops"] is None
            torch.testing.assert_close(KeelForCausalLM.from_pretrained(tmp_path / "again").eval()(ids).logits,
                                       loaded(ids).logits, atol=1e-5, rtol=0)
    for bad in (0, 2.5):
        with pytest.raises(KeelError, match="the loop count must be an integer >= 1"):
            KeelForCausalLM.from_pretrained(tmp_path, loops=bad)
    with pytest.raises(KeelError, match=r"a loop count needs a looped model \(model.loop_core >= 1\)"):
        KeelForCausalLM(KeelConfig.from_model_config(dataclasses.replace(native.cfg, **NO_LOOP), loops=2))
    with pytest.raises(KeelError, match="a looped model .* is not a stock Llama"):
        to_llama(native)
