"""``keel study NAME --scale SCALE``: a study of the paper's claims, declared as data, run on
the grid runner, reported with verdicts computed from paired seeds.

A study is a TOML file (packaged in ``keel/configs/studies/``, e.g. ``claims.toml``) with

* ``[groups.G]``: a set of training runs, schemes x sub-layers x peak LRs x seeds, with extra
  config keys (``set``). ``kind = "ramp"`` makes it the paper's max-LR stress test
  (:mod:`keel.experiments.stress`: LR 0 -> ``peak_lr`` over ``ramp_steps``, a ``pre_ln``
  reference run per depth and seed); ``lr_from = "G2"`` trains every scheme at the optimal LR
  of group G2 at ``lr_from_sublayers`` sub-layers (the seed-mean curve's argmin), once
  those runs have finished (LR transfer across depth), and at the points of G2's LR grid
  ``lr_from_steps`` away from it (e.g. ``[0, -1]``: the optimum and the next lower LR).
  ``note``: text for the report's section of a group that no claim reads (e.g. the showcase).
  ``baselines_from = "G2"`` with ``baselines = ["keel", ...]``: that section pairs each scheme
  with those schemes of G2 at the same depths, seeds and LRs (e.g. the residual bench against
  the lr-grid's Keel and Pre-LN; :func:`baseline_margins`).
  ``seeds_for = { scheme = [seeds] }``: a scheme trained at other seeds than the group's (e.g. one
  no verdict reads, kept at fewer). ``widen`` (default 2): a cell a claim reads whose best LR is
  the lowest or highest it trained gets the next LR beyond that edge, at most ``widen`` per side
  (:func:`run.widened_lrs`), so every optimum a verdict reads is bracketed.
  Config keys apply in the order scale ``set``, group ``set``, the user's ``--set`` (later wins).
* ``[[claims]]``: per claim of the paper, its kind (``test``, a name in :data:`claims.CLAIMS`:
  ``margin_grows``, ``lr_transfer``, ``max_lr_order``) and the groups and schemes it reads. A
  ``max_lr_order`` claim may name an ``extended_group``: its ramp continued at the same LR per
  step to a higher peak, where the pairs that the first peak censors are reported beside the
  paper's ramp, which gives the verdict (optional per scale). A ``margin_grows`` claim may name
  ``init_groups``: the same depths at another embedding init; it is then judged at the paper's
  init and at each scheme's better init. A study without claims is a study of groups only (e.g.
  a bench paired by ``baselines_from``): its report has no verdicts.
* ``[scales.S]``: for each scale (``tiny`` for the test suite, ``cpu``, ``gpu-1``, ``paper``)
  the config keys of every run (``set``) and each group's sizes (``[scales.S.groups.G]``).
* ``[verdict]``: ``min_effect`` (nats/token), ``min_seeds`` and ``floor_from_spread`` of
  :func:`verdicts.paired_verdict` (one-sided 95% t bounds against a floor; the floor from the
  median seed-to-seed sd of the best loss, :func:`verdicts.loss_floor`, when ``floor_from_spread``).

Every run is an ordinary ``keel train`` run (:func:`keel.experiments.sweep.train_task`):
finished runs are cached, interrupted ones resume (``--resume``), groups run in file order
(``--groups ramp,init`` trains only those, e.g. the cheap groups first).
Layout of ``--out``::

    OUT/<group>/<run>/          one training run (grid job: job.json, result.json, run.log, ...)
    OUT/<ramp group>/references/<run>/   the stress test's reference runs
    OUT/report.md, report.json  the verdicts, the per-claim tables, every run's numbers
    OUT/*.png                   loss against LR per group, the ramp, margins against depth, showcase

The verdict vocabulary is ``reproduced`` / ``not reproduced`` / ``inconclusive``, computed, never
written by hand, and each claim's one-line summary is written from those numbers
(:func:`report.claim_summary`; ``report.json``'s ``summary``):
by :func:`verdicts.paired_verdict` on paired per-seed differences for every
claim test but :func:`verdicts.claim_lr_transfer`, whose rule (same optimal grid point in every
seed) is its own.

Modules, each importing only those before it: :mod:`.spec` (the TOML as :class:`spec.Study`,
its groups checked), :mod:`.verdicts` (the paired-difference rule, one verdict function per kind
of claim), :mod:`.cells` (numbers as markdown cells), :mod:`.claims` (one class per kind of
claim: its keys, verdict, reads and tables, the registry :data:`claims.CLAIMS`, and
:func:`claims.load_study`, which checks every claim), :mod:`.report` (``report.md`` and the
PNGs), :mod:`.run` (jobs, run records, the dry-run estimate, :func:`run.run_study`).
"""

