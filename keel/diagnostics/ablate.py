"""``keel ablate``: layer importance, ΔPPL_i = PPL(model with sub-layer i removed) − PPL(full).

Keel paper, Appendix A: remove one layer at a time and measure the perplexity increase on
validation text; Keel shows much less redundancy in its shallow layers than Pre-LN. The
perplexity is ``exp(mean next-token cross-entropy)`` over the same validation windows for
every model (nats → PPL; tokens counted are the predicted ones).

What "removing sub-layer i" means here: the whole residual unit of sub-layer i is bypassed,
``x_{i+1} = x_i``. It is done from outside the model, by replacing the unit's ``forward``
(``unit(x, F) -> x_next``, :mod:`keel.model.residual`) with ``lambda x, f: x`` for the
duration of a ``with`` block (:func:`removed_sublayer`); F is then never called. (Strictly,
with the unit's ``removed(x)``: ``x`` for every scheme but AttnRes, see the table.)

==============  ===========================================  ==========================================
scheme          unit of sub-layer i                          removed (bypassed) means
==============  ===========================================  ==========================================
``pre_ln``      ``x + F(Norm(x))``                           ``x``: F's update is dropped; the final
                                                             Norm before the LM head stays
``post_ln``     ``Norm(x + F(x))``                           ``x``: F *and its outer Norm* are skipped
``deepnorm``    ``Norm(α·x + F(x))``                         ``x``: F and the outer Norm skipped
``keel``        ``Norm_out(α·x + F(Norm_in(x)))``            ``x``: F, Norm_in and Norm_out skipped.
                                                             First-layer rule: sub-layer 0 is plain
                                                             Pre-LN ``x + F(Norm_in(x))`` (no outer
                                                             norm), so removing it drops only F;
                                                             sub-layer 1 has α = 1 and keeps Norm_out
``hybridnorm``  (any unit with the same interface)           ``x`` (F, QKV norms inside F, outer norms)
``mix_ln``      Post-LN lower blocks, Pre-LN upper blocks    ``x``, as for the scheme of that block
``peri_ln``     ``x + Norm_out(F(Norm_in(x)))``              ``x``: F and both its norms skipped
``hyper_conn``  n streams H, ``A_r^T H + B F(Norm(A_m^T H))``  ``H``: the n streams pass unchanged
``mhc``         ``H_res H + H_post^T F(Norm(H_pre H))``      ``H``: the n streams pass unchanged
``attn_res``    F(Norm(softmax-weighted earlier outputs))    F's output is taken as 0
                                                             (``AttnRes.removed``): the sub-layer adds
                                                             nothing to its block's partial sum; the
                                                             block structure stays. In Full AttnRes
                                                             the zero source still takes softmax
                                                             weight (its logit is 0)
==============  ===========================================  ==========================================

Zeroing a norm's gain instead would not be "removal" for Post-LN or Keel: the outer norm
would then zero the whole stream. With Post-LN/Keel the skipped outer norm means the
stream entering sub-layer i+1 is not re-normalised; every later unit normalises it again.

Hugging Face causal LMs (``--hf PATH``, as the paper did for Qwen and Llama): one decoder
layer (attention + MLP with their norms and residuals) is one unit; removing it replaces
``model.model.layers[i].forward`` with the identity on the hidden states, returning them in
the layer's own convention (a tensor in transformers >= 4.54, a 1-tuple before; detected
by running the full model once). The final norm stays.

Outputs (``--out``, default ``RUN/ablate``; required with ``--hf``, a folder keel did not write):
``ablate.json``, ``ablate.md`` and ``ablate.png`` (bar chart of ΔPPL per sub-layer, log y when the
range calls for it), each marked as keel's (:data:`MARK`; the plot: :data:`keel.train.plots.PLOT_MARK`).
The folder must be new, empty or hold only such an ablation (:func:`check_out`): keel overwrites no file of the user's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Callable, Iterator

import torch
from matplotlib.patches import Patch

from keel.data import load_tokenizer, split_windows, validation_tokens
from keel.data.shards import read_shard
from keel.data.text import encode_text, read_text_file
from keel.errors import KeelError, plural
from keel.io import atomic_files, check_output_folder, load_hf_tokenizer, weights_load_errors
from keel.run import Run
from keel.rundir import RunDir
from keel.train.nll import mean_nll
from keel.train.plots import plt, save_figure, written_by_keel

_log = logging.getLogger(__name__)  # one DEBUG line per unit removed (keel ablate --verbose)


# ----------------------------------------------------------------------------- removal
def _unit(model, index: int):
    """The residual unit of sub-layer ``index`` of a keel Transformer (paper order,
    :meth:`keel.model.Transformer.sublayers`)."""
    units = [unit for _, unit, _ in model.sublayers()]
    if not 0 <= index < len(units):
        raise KeelError(f"sub-layer index {index} out of range 0..{len(units) - 1}")
    return units[index]


@contextlib.contextmanager
def removed_sublayer(model, index: int | None) -> Iterator[None]:
    """Within the block, sub-layer ``index`` of a keel ``Transformer`` is bypassed: its residual
    unit returns its input unchanged (``x_{i+1} = x_i``, F not called). ``None`` removes nothing.

    The unit's ``forward`` is shadowed by an instance attribute and restored on exit (also on
    error). Raises KeelError for an index outside ``0 .. L-1``.
    """
    if index is None:
        yield
        return
    unit = _unit(model, index)
    unit.forward = lambda x, f: unit.removed(x)
    try:
        yield
    finally:
        del unit.forward


@contextlib.contextmanager
def removed_hf_layer(model, index: int | None, returns_tuple: bool) -> Iterator[None]:
    """Within the block, decoder layer ``index`` of a Hugging Face causal LM
    (``model.model.layers``) is the identity on its hidden states.

    ``returns_tuple``: whether the layer returns ``(hidden_states, ...)`` (transformers < 4.54)
    rather than the tensor; the replacement returns ``(hidden_states,)`` then.
    """
    if index is None:
        yield
        return
    layers = hf_layers(model)
    if not 0 <= index < len(layers):
        raise KeelError(f"decoder layer index {index} out of range 0..{len(layers) - 1}")
    layer = layers[index]

    def identity(hidden_states, *args, **kwargs):
        return (hidden_states,) if returns_tuple else hidden_states

    layer.forward = identity
    try:
        yield
    finally:
        del layer.forward


def hf_layers(model):
    """The decoder layers (``nn.ModuleList``) of a Hugging Face causal LM. Raises KeelError."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise KeelError(f"{type(model).__name__} has no model.layers (not a Llama/Qwen-style causal LM)")
    return layers


def _capped_ppl(nll: float) -> float:
    """``exp(min(nll, 700))``: 700 nats is just below float64's exp overflow (709.8)."""
    return math.exp(min(nll, 700.0))


def layer_importance(n_units: int, nll_with: Callable[[int | None], float]) -> dict:
    """ΔPPL for every unit: ``nll_with(i)`` is the mean NLL with unit ``i`` removed (``None``: full).

    Returns ``{"nll_full", "ppl_full", "units": [{"index", "nll", "ppl", "delta_ppl"}, ...]}``
    with ``ppl = exp(min(nll, 700))`` (capped so that a blown-up NLL gives a huge finite PPL, not
    an OverflowError, and ΔPPL stays a number in the JSON) and ``delta_ppl = ppl - ppl_full``
    (Keel paper, Appendix A). Each unit's PPL is logged at DEBUG level (logger ``keel.diagnostics.ablate``).
    """
    nll_full = nll_with(None)
    ppl_full = _capped_ppl(nll_full)
    units = []
    for i in range(n_units):
        nll = nll_with(i)
        ppl = _capped_ppl(nll)
        units.append({"index": i, "nll": nll, "ppl": ppl, "delta_ppl": ppl - ppl_full})
        _log.debug(f"  unit {i}: PPL {ppl:.3f} (ΔPPL {ppl - ppl_full:+.3f})")
    return {"nll_full": nll_full, "ppl_full": ppl_full, "units": units}


def _applications(model) -> list[tuple[int, int | None]]:
    """Per sub-layer a looped ``model`` applies (at :attr:`~keel.model.Transformer.loops`), in order:
    ``(its sub-layer of weights, 2b or 2b + 1 of block b; the core application 0 .. R-1, None in the
    prelude and coda)`` (:meth:`keel.model.Transformer.depth_order`)."""
    P, C = model.cfg.loop_prelude, model.cfg.loop_core
    out = []
    for slot, b in enumerate(model.depth_order()):
        application = (slot - P) // C if P <= b < P + C else None
        out += [(2 * b, application), (2 * b + 1, application)]
    return out


# Bytes of residual-stream states :class:`_StreamPrefix` may keep (on the model's device) while one model is ablated.
PREFIX_CACHE_BYTES = 2 * 2**30


class _StreamPrefix:
    """The full pass's residual-stream states, kept so that an ablation pass need not recompute them.

    Removing sub-layer i leaves units 0 .. i-1 as they are, so their outputs equal the full pass's bit for
    bit (the same inputs through the same kernels). During the full pass (:meth:`recording`) the output of
    every ``every``-th unit (0-based units ``every - 1``, ``2 every - 1``, ...) is kept for each batch, in
    the order the batches ran; in the pass that removes unit i (:meth:`resumed`), with ``c`` the last kept
    unit before i, units ``0 .. c - 1`` return their input unchanged (cheap: nothing is computed) and unit
    ``c`` returns its kept output for the batch at hand, so the pass computes only units ``c + 1 .. L - 1``:
    about half the work of recomputing all of them, over every i. ``every`` is the smallest spacing whose
    states fit in ``budget`` bytes, from unit 0's first output (:data:`PREFIX_CACHE_BYTES`; a unit's
    output is the whole stream state: [B, T, d] floats, [n, B, T, d] for the multi-stream schemes, the
    tuple of earlier outputs for AttnRes). Each kept unit must be called once per batch in both passes,
    as :func:`keel.train.nll.summed_nll` does; a pass that asks for more batches than were kept raises
    RuntimeError, a bug rather than a user error.
    """

    def __init__(self, units: list, n_batches: int, budget: int = PREFIX_CACHE_BYTES):
        self.units, self.n_batches, self.budget = units, n_batches, budget
        self.every: int | None = None  # fixed by the first output the full pass gives
        self.kept: dict[int, list] = {}

    @staticmethod
    def _nbytes(out) -> int:
        return sum(t.nbytes for t in (out if isinstance(out, (tuple, list)) else (out,)))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Within the block, a forward pass over the batches keeps every ``every``-th unit's output."""
        def keep(index):
            def hook(module, args, out):
                if self.every is None:  # unit 0, batch 0: size the spacing
                    per_unit = max(1, self._nbytes(out)) * self.n_batches
                    self.every = max(1, math.ceil(len(self.units) * per_unit / max(1, self.budget)))
                if self.budget > 0 and (index + 1) % self.every == 0:
                    self.kept.setdefault(index, []).append(out)
            return hook

        handles = [unit.register_forward_hook(keep(i)) for i, unit in enumerate(self.units)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def resumed(self, index: int) -> Iterator[None]:
        """Within the block, units before the last kept one before ``index`` pass their input through and that
        one gives its kept outputs, batch by batch; without a kept unit before ``index``, nothing changes."""
        c = max((k for k in self.kept if k < index), default=None)
        if c is None:
            yield
            return
        outputs = iter(self.kept[c])

        def kept_output(x, f):
            out = next(outputs, None)
            if out is None:
                raise RuntimeError(f"ablation pass ran more batches than the {len(self.kept[c])} the full pass kept")
            return out

        shadowed = self.units[:c + 1]
        for unit in shadowed[:-1]:
            unit.forward = lambda x, f: x
        shadowed[-1].forward = kept_output
        try:
            yield
        finally:
            for unit in shadowed:
                del unit.forward


def ablate_model(model, windows, batch_size: int = 16, cache_bytes: int = PREFIX_CACHE_BYTES) -> dict:
    """:func:`layer_importance` of a keel ``Transformer`` over ``windows`` [N, T+1] (its device).

    Units are sub-layers: index 2b = attention of block b, 2b+1 = FFN of block b.
    Adds ``scheme``, ``blocks`` (of weights: ``cfg.n_layers``), ``applied_blocks`` (the blocks one pass applies:
    ``blocks``, or P + R C + Q of a looped model), ``sublayers`` (2 ``applied_blocks``) and per unit ``block``
    (its applied block) and ``kind`` (attn/ffn).
    A looped model (at its :attr:`~keel.model.Transformer.loops`) is ablated per applied sub-layer: unit i
    is the i-th sub-layer the pass applies, one application of a core sub-layer removed while its
    other applications stay (on :meth:`keel.model.Transformer.unrolled`, which shares the weights);
    each unit adds ``weight_sublayer`` (its sub-layer of weights) and ``application`` (its core
    application 0 .. R-1, None in the prelude and coda), the result ``loop``.

    The pass that removes sub-layer i starts from the full pass's stream state before it (kept in at most
    ``cache_bytes`` bytes on the model's device, :class:`_StreamPrefix`; 0 keeps none: every pass starts from the
    embedding),
    which gives the same numbers, bit for bit, as recomputing sub-layers 0 .. i-1, in about half the time.
    """
    device = next(model.parameters()).device
    windows = windows.to(device)
    model.eval()
    looped = model if model.cfg.loop_core else None
    if looped is not None:
        model = looped.unrolled()  # a module per application: removing one leaves the others
    units = [unit for _, unit, _ in model.sublayers()]
    prefix = _StreamPrefix(units, math.ceil(windows.shape[0] / batch_size), cache_bytes)

    def nll_with(i):
        with removed_sublayer(model, i), (prefix.recording() if i is None else prefix.resumed(i)):
            return mean_nll(model, windows, batch_size, device)

    L = 2 * len(model.blocks)
    out = layer_importance(L, nll_with)
    for u in out["units"]:
        u["block"], u["kind"] = u["index"] // 2, ("attn" if u["index"] % 2 == 0 else "ffn")
    weights = model if looped is None else looped  # the unrolled model's blocks are applications
    out.update(scheme=model.cfg.residual, blocks=weights.cfg.n_layers, applied_blocks=L // 2, sublayers=L,
               unit="sub-layer", tokens=int(windows[:, 1:].numel()), seq_len=int(windows.shape[1]) - 1)
    if looped is not None:
        for u, (weights, application) in zip(out["units"], _applications(looped)):
            u["weight_sublayer"], u["application"] = weights, application
        out["loop"] = looped.loop_shape()
    return out


def ablate_hf_model(model, windows, batch_size: int = 8) -> dict:
    """:func:`layer_importance` of a Hugging Face causal LM; one unit = one decoder layer."""
    device = next(model.parameters()).device
    windows = windows.to(device)
    model.eval()
    layers = hf_layers(model)
    seen = {}

    def probe(module, args, output):  # returns None: the output is left as it is
        seen["tuple"] = isinstance(output, tuple)

    hook = layers[0].register_forward_hook(probe)

    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits

    try:
        with torch.no_grad():
            logits(windows[:1, :2])
    finally:
        hook.remove()
    returns_tuple = seen.get("tuple", False)

    def nll_with(i):
        with removed_hf_layer(model, i, returns_tuple):
            return mean_nll(logits, windows, batch_size, device)

    out = layer_importance(len(layers), nll_with)
    for u in out["units"]:
        u["block"], u["kind"] = u["index"], "layer"
    out.update(scheme=f"hf:{type(model).__name__}", blocks=len(layers), applied_blocks=len(layers),
               sublayers=2 * len(layers), unit="decoder layer", tokens=int(windows[:, 1:].numel()),
               seq_len=int(windows.shape[1]) - 1)
    return out


# ----------------------------------------------------------------------------- outputs
def _in_windows(res: dict) -> str:
    """" in windows of N tokens" (a result written before ``seq_len`` was recorded: "")."""
    return f" in windows of {res['seq_len']} tokens" if res.get("seq_len") else ""


def _text_of(res: dict) -> str:
    """What the tokens were: "tokens of FILE" for ``--text FILE`` (``res["text"]``), else "validation tokens"."""
    return f"tokens of {res['text']}" if res.get("text") else "validation tokens"


def _blocks_words(res: dict) -> str:
    """"32 blocks", or for a looped model "10 blocks of weights, 514 applied" (a result written before
    ``applied_blocks`` was recorded counted applied blocks in ``blocks``)."""
    applied = res.get("applied_blocks", res["blocks"])
    if applied == res["blocks"]:
        return plural(applied, "block")
    return f"{plural(res['blocks'], 'block')} of weights, {applied:,} applied"


def ablate_markdown(res: dict, title: str) -> str:
    """Markdown table of an ablation result."""
    lines = [f"# Layer importance: {title}", "",
             f"{res['scheme']}, {_blocks_words(res)} = {res['sublayers']} sub-layers; "
             f"unit removed = one {res['unit']}; {res['tokens']:,} {_text_of(res)}{_in_windows(res)}. "
             f"Full model: PPL {res['ppl_full']:.3f} (loss {res['nll_full']:.4f} nats/token). "
             "ΔPPL = PPL without the unit − PPL of the full model.", "",
             "| index | block | unit | PPL without | ΔPPL |", "|---|---|---|---|---|"]
    loop = res.get("loop")
    if loop:  # a looped model: the applied sub-layers, each with its sub-layer of weights and core application
        lines[2] += (f" Looped: {loop['prelude']} + {loop['core']} x {loop['repeats']} + {loop['coda']} blocks (trained "
                     f"at {loop['trained_repeats']}); one application of a core sub-layer is removed at a time.")
        lines[4:6] = ["| index | block | unit | weights | application | PPL without | ΔPPL |", "|---" * 7 + "|"]
    for u in res["units"]:
        looped = f" {u['weight_sublayer']} | {'-' if u['application'] is None else u['application']} |" if loop else ""
        lines.append(f"| {u['index']} | {u['block']} | {u['kind']} |{looped} {u['ppl']:.3f} | {u['delta_ppl']:+.3f} |")
    return "\n".join(lines) + "\n"


def plot_ablation(res: dict, out: str | Path, title: str = "") -> None:
    """Bar chart of ΔPPL per unit (Keel paper Appendix A style); symmetric-log y axis when
    the largest |ΔPPL| is over 50x the median one."""
    d = [u["delta_ppl"] for u in res["units"]]
    colors = ["tab:blue" if u["kind"] in ("attn", "layer") else "tab:orange" for u in res["units"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * len(d) + 3), 4))
    ax.bar(range(len(d)), d, color=colors)
    mags = sorted(abs(x) for x in d if math.isfinite(x))
    if mags and mags[-1] > 50 * max(mags[len(mags) // 2], 1e-9):
        ax.set_yscale("symlog", linthresh=max(mags[len(mags) // 2], 1e-3))
    unit = res["unit"]
    ax.set_xlabel(f"{unit} index" + (" (even = attention, odd = FFN)" if unit == "sub-layer" else ""))
    ax.set_ylabel("ΔPPL (PPL without it − full PPL)")
    ax.set_title(title or f"layer importance: {res['scheme']}, {res['sublayers']} sub-layers "
                 f"(full PPL {res['ppl_full']:.2f})")
    if unit == "sub-layer":
        ax.legend(handles=[Patch(color="tab:blue", label="attention"), Patch(color="tab:orange", label="FFN")])
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, out)


OUTPUTS = ("ablate.json", "ablate.md", "ablate.png")
MARK = "keel ablate"  # ablate.json's "written_by"; ablate.md's last line is MD_MARK: the files keel may overwrite
MD_MARK = f"<!-- written by {MARK} -->"
_MARK_READ_MAX = 16 << 20  # bytes: a bigger ablate.json / ablate.md is none of keel's


def written_by_ablate(path: Path) -> bool:
    """Whether ``path`` is one of the files :func:`write_outputs` wrote: ``ablate.json`` with
    ``"written_by": MARK``, ``ablate.md`` ending in :data:`MD_MARK`, ``ablate.png`` with the mark of
    keel's plots (:func:`keel.train.plots.written_by_keel`). Unreadable: False."""
    if path.name == "ablate.png":
        return written_by_keel(path)
    if path.name not in OUTPUTS or path.is_symlink() or not path.is_file():
        return False
    with contextlib.suppress(OSError, ValueError):
        if path.stat().st_size <= _MARK_READ_MAX:
            text = path.read_text(encoding="utf-8")
            if path.name == "ablate.md":
                return text.rstrip().endswith(MD_MARK)
            data = json.loads(text)
            return isinstance(data, dict) and data.get("written_by") == MARK
    return False


def check_out(out_dir: str | Path, flag: str = "--out") -> None:
    """Refuse an output folder that is not new, empty or an ablation keel wrote (:func:`written_by_ablate`),
    before the ablation's minutes (:func:`keel.io.check_output_folder`).

    Raises:
        KeelError: one line naming ``flag`` and the first entries keel did not write, or that ``out_dir`` is a
            training run's folder.
    """
    if RunDir(out_dir).is_run():  # keel wrote it, but a run is no ablation
        raise KeelError(f"{flag} {out_dir} is a training run's folder, not an ablation: give --out a new or empty "
                        "folder (e.g. RUN/ablate)")
    check_output_folder(out_dir, flag, written_by_ablate, "an ablation")


def write_outputs(res: dict, out_dir: str | Path, title: str) -> dict:
    """``ablate.json``, ``ablate.md`` and ``ablate.png`` in ``out_dir`` (created), atomically, each
    marked as keel's; ``out_dir`` must pass :func:`check_out`. Returns what ``ablate.json`` holds
    (``res`` and its mark).

    Raises:
        KeelError: ``out_dir`` holds files keel did not write (:func:`check_out`), or a write failed.
    """
    check_out(out_dir)
    marked = {**res, "written_by": MARK}
    with atomic_files(out_dir) as tmp:  # all three or none (a full disk)
        (tmp / "ablate.json").write_text(json.dumps(marked, indent=1), encoding="utf-8")
        (tmp / "ablate.md").write_text(ablate_markdown(res, title) + f"\n{MD_MARK}\n", encoding="utf-8")
        plot_ablation(res, tmp / "ablate.png")
    return marked


# ----------------------------------------------------------------------------- command


# ----------------------------------------------------------------------------- sources
def text_windows(ids, seq_len: int, max_tokens: int):
    """Whole windows of token ids ``ids`` (:func:`keel.data.split_windows`, at most ``max_tokens``
    tokens) stacked into an int64 tensor [N, seq_len + 1]. Raises KeelError if there is none."""
    rows = split_windows(ids, seq_len, max_tokens)
    if not rows:
        raise KeelError(f"text too short: {len(ids)} tokens, need at least {seq_len + 1}")
    return torch.stack(rows)


def check_tokens(tokens: int, seq_len: int) -> None:
    """Raise KeelError for ``--tokens`` below one window of ``seq_len`` tokens (an ablation then measured
    one whole window, more tokens than asked, without a word; ``keel eval --max-tokens`` refuses it too)."""
    if tokens < seq_len:
        raise KeelError(f"--tokens {tokens} is less than one window of {seq_len} tokens (--seq-len); "
                        f"give at least {seq_len}")


def ablate_run(run_dir: str | Path, seq_len: int | None = None, tokens: int = 16384, batch_size: int = 16,
               device: str = "auto", text: str | None = None, loops: int | None = None) -> dict:
    """:func:`ablate_model` of a keel run's latest checkpoint on the first ``tokens`` tokens of
    its validation split (or of ``text``, in the run's tokenizer), in windows of ``seq_len``
    (default: the run's ``train.seq_len``); a looped run's core applied ``loops`` times (None: its
    ``model.loop_repeats``).

    Raises:
        KeelError: not a run, no checkpoint, ``seq_len`` outside [1, model.max_seq_len], ``tokens``
            below one window, too little validation data or text, a ``loops`` below 1 or for a run that does not loop.
    """
    run = Run(run_dir)
    model = run.load_model(device=device)
    if loops is not None:
        model.set_loops(loops)
    seq = seq_len if seq_len is not None else run.config.train.seq_len
    if not 1 <= seq <= model.cfg.max_seq_len:
        raise KeelError(f"--seq-len must be between 1 and model.max_seq_len = {model.cfg.max_seq_len}, got {seq}")
    check_tokens(tokens, seq)
    if text is not None:
        windows = text_windows(encode_text(run.tokenizer(), text), seq, tokens)  # as keel eval --text: <|endoftext|> is text
    else:
        windows = validation_tokens(run.data_dir(), seq, tokens)
    return ablate_model(model, windows, batch_size=batch_size)


def ablation_text(text_file: str | None, run_dir: str | None, tokens: int) -> str:
    """The text to ablate on: ``text_file`` (invalid UTF-8 becomes U+FFFD), else the start of a
    keel run's validation split decoded to text (about ``4 * tokens`` of its tokens; what
    ``--hf`` measures on without ``--text``).
    Raises KeelError if neither is given or readable."""
    if text_file:
        return read_text_file(text_file)[0]
    if run_dir is None:
        raise KeelError("--hf needs --text FILE or --run DIR (its validation split) for the text")

    data_dir = Run(run_dir).data_dir()
    val = read_shard(Path(data_dir) / "val.bin")
    n = min(len(val), 4 * tokens + 1024)  # enough text for the HF tokenizer
    return load_tokenizer(data_dir).decode(val[:n].tolist())


def ablate_hf_folder(path: str | Path, text: str, seq_len: int | None = None, tokens: int = 16384,
                     batch_size: int = 8) -> dict:
    """:func:`ablate_hf_model` of a local Hugging Face causal-LM folder on ``text`` (fp32),
    windows of ``seq_len`` tokens (default: min(512, max_position_embeddings)).
    Raises KeelError: not a folder, a tokenizer that cannot be loaded, or text shorter than one window."""
    from transformers import AutoModelForCausalLM  # optional extra [hf], ~1.7 s to import: only for --hf

    path = Path(path)
    if not path.is_dir():
        raise KeelError(f"--hf expects a local model folder (save_pretrained), got {path}")
    tok = load_hf_tokenizer(path)  # a missing or damaged tokenizer: one line (a traceback before)
    with weights_load_errors(path):  # a missing or truncated model.safetensors: one line
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    seq = seq_len or min(512, getattr(model.config, "max_position_embeddings", 512))
    check_tokens(tokens, seq)
    return ablate_hf_model(model, text_windows(ids, seq, tokens), batch_size=batch_size)
