"""torch.compile with zero graph breaks, for every residual scheme, with and without activation
checkpointing, per block (what ``train.compile`` does) and whole model, forward and backward.

``fullgraph=True`` makes any graph break an error; the ``aot_eager`` backend runs Dynamo and
AOTAutograd (the joint forward + backward graph, the activation-checkpointing partition)
without inductor's code generation, and ``eager`` runs Dynamo alone, so the tests take
seconds (about 1 min for the file on 2 busy cores). Gradients must equal the
eager model's (same kernels, up to fp32 reassociation).
"""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from keel import ModelConfig, Transformer
from keel.model import SCHEMES
from keel.train.parallelize import apply_activation_checkpointing, apply_compile

pytestmark = pytest.mark.compiles
ALL = sorted(SCHEMES)


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_thread):
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def tiny(scheme, n_layers=3):
    return ModelConfig(vocab_size=61, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, d_ff=64,
                       max_seq_len=16, residual=scheme)


def _pair(scheme, ac):
    torch.manual_seed(0)
    eager = Transformer(tiny(scheme))
    model = Transformer(tiny(scheme))
    model.load_state_dict(eager.state_dict())
    apply_activation_checkpointing(model, ac)
    return eager, model


def _loss_and_grads(fn, model, ids):
    loss = fn(ids, ids.roll(-1, 1))
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _assert_same(eager, compiled_fn, compiled_model):
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    loss0, grads0 = _loss_and_grads(eager, eager, ids)
    loss1, grads1 = _loss_and_grads(compiled_fn, compiled_model, ids)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1  # something was compiled
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for g1, g0 in zip(grads1, grads0):
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)


# mhc without checkpointing is slow (~35 s) and adds little to [mhc-block] and the whole-model [mhc-none]
@pytest.mark.parametrize("scheme, ac", [pytest.param(s, ac, marks=pytest.mark.slow) if (s, ac) == ("mhc", "none")
                                        else (s, ac) for s in ALL for ac in ("none", "block")])
def test_per_block_compile_has_no_graph_break(scheme, ac):
    """``apply_compile`` (fullgraph) after ``apply_activation_checkpointing``: forward and backward
    compile without a break, blocks share their graphs where they can (Keel's first-layer
    rule makes block 0 different), and the gradients equal eager ones."""
    eager, model = _pair(scheme, ac)
    apply_compile(model, backend="aot_eager")
    _assert_same(eager, model, model)
    # blocks share graphs where their code and constants agree (pre_ln: 1 graph for 3 blocks);
    # never more than one per block (AttnRes: each block sees a different history)
    assert counters["stats"]["unique_graphs"] <= (1 if scheme == "pre_ln" else 3)


@pytest.mark.parametrize("ac", ["none", "block"])
@pytest.mark.parametrize("scheme", ALL)
def test_whole_model_compile_has_no_graph_break(scheme, ac):
    """``torch.compile(model, fullgraph=True)``: embedding, blocks, final norm and the chunked
    LM-head loss in one Dynamo graph (backend ``eager``: graph breaks are Dynamo's; the
    per-block test above runs AOTAutograd's joint graph)."""
    eager, model = _pair(scheme, ac)
    _assert_same(eager, torch.compile(model, backend="eager", fullgraph=True), model)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("scheme", ["pre_ln", "keel", "mhc"])
def test_a_looped_core_compiles_once_at_any_loop_count(scheme):
    """A looped model (prelude 1, core 2 x R, coda 1) compiled per block: the graphs made at R = 1 serve
    every later pass at R = 2, 4 and 7 (no new graph, no recompile: the core's blocks are the same
    modules each application), forward and backward, with the eager model's loss and gradients."""
    cfg = dataclasses.replace(tiny(scheme, n_layers=4), loop_prelude=1, loop_core=2, loop_repeats=3)
    torch.manual_seed(0)
    eager = Transformer(cfg)
    model = Transformer(cfg)
    model.load_state_dict(eager.state_dict())
    apply_compile(model, backend="aot_eager")
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    graphs = []
    for loops in (1, 2, 4, 7):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
            m(ids, ids.roll(-1, 1), loops=loops).backward()
        graphs.append(counters["stats"]["unique_graphs"])
        for p, q in zip(eager.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # a recompile would add a graph (a new window length does: 2 -> 4 for keel); pre_ln: 1, keel: 2 (block 0)
    assert 1 <= graphs[0] <= len(model.blocks) and graphs == [graphs[0]] * 4, graphs


def _saved_activation_bytes(fn, ids):
    """Bytes autograd saves for the backward in one forward, parameters excluded."""
    total = [0]

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(ids, ids)
    loss.backward()
    return total[0]


def test_activation_checkpointing_takes_effect_under_compile():
    """Compiled after checkpointing, a block keeps only its input for the backward: the saved
    activations shrink as much as in eager mode (block inputs + the loss's gradients)."""
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    saved = {}
    for ac in ("none", "block"):
        torch._dynamo.reset()
        _, model = _pair("keel", ac)
        apply_compile(model, backend="aot_eager")
        saved[ac] = _saved_activation_bytes(model, ids)
    block_inputs = 3 * 2 * 12 * 32 * 4  # one [B, T, d] fp32 input per block
    assert saved["block"] < saved["none"] / 3
    assert saved["block"] < block_inputs + 40_000  # + the chunked loss's dh, dw and small tensors


def test_gradflow_jvp_still_uses_the_fused_norm():
    """Eager calls keep the hand-written derivatives (forward-mode AD works through the fused op),
    and the traceable composite under compile is the same function."""
    from keel.model.norm import _rms_norm_of_sum_composite, rms_norm_of_sum

    g = torch.Generator().manual_seed(0)
    x, f, w = (torch.randn(3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out, tangent = torch.func.jvp(lambda a: rms_norm_of_sum(a, f, w, 0.5, 1e-3), (x,), (torch.ones_like(x),))
    ref, ref_tangent = torch.func.jvp(lambda a: _rms_norm_of_sum_composite(a, f, w, 0.5, 1e-3), (x,),
                                      (torch.ones_like(x),))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tangent, ref_tangent, rtol=1e-10, atol=1e-12)


def _train_eval_sample(model: Transformer, vocab: int) -> None:
    """One training step's forward + backward, then no-grad evaluation and sampling-prompt shapes."""
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    model(ids, ids.roll(-1, 1)).backward()
    with torch.no_grad():
        for shape in [(1, 12), (3, 7), (1, 1), (2, 16)]:
            model(torch.randint(0, vocab, shape))


# the schemes whose blocks differ (a graph per block or per kind of block) in the default tier, the rest slow
DISTINCT_BLOCKS = ("attn_res", "keel", "mhc")


@pytest.mark.parametrize("scheme", [s if s in DISTINCT_BLOCKS else pytest.param(s, marks=pytest.mark.slow) for s in ALL])
def test_per_block_compile_at_16_sublayers_trains_evaluates_and_samples(scheme):
    """8 blocks compiled per block (``fullgraph``): a training step, then evaluation and sampling
    shapes without grad, with no recompile-limit hit. Attention Residuals (a graph per block: each
    sees a different history) failed at step 1 from 5 blocks on, when every block shared Dynamo's 8."""
    model = Transformer(tiny(scheme, n_layers=8))
    apply_compile(model, backend="eager")
    _train_eval_sample(model, 61)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ALL)
def test_per_block_compile_at_64_sublayers_trains_evaluates_and_samples(scheme):
    """As above at the bench's depth, 64 sub-layers (32 blocks): about 3 min for attn_res on CPU."""
    model = Transformer(tiny(scheme, n_layers=32))
    apply_compile(model, backend="eager")
    _train_eval_sample(model, 61)
    assert not counters["graph_break"], dict(counters["graph_break"])
