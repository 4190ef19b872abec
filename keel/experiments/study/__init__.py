"""``keel study NAME --scale SCALE``: a study of the paper's claims, declared as data, run on
the grid runner, reported with verdicts computed from paired seeds.

A study is a TOML file (packaged in ``keel/configs/studies/``, e.g. ``claims.toml``, whose comments
walk through the format): ``[groups.G]`` sets of runs (schemes x sub-layers x peak LRs x seeds, an
LR grid or the paper's max-LR ramp; each key declared, with its meaning, on :class:`spec.Group`),
``[[claims]]`` (one kind of :data:`claims.CLAIMS` each, naming the groups and schemes it reads),
``[scales.S]`` (the config keys of every run and each group's sizes at ``tiny``, ``cpu``, ``gpu-1``,
``paper``; a file without ``[scales]`` has one size, its groups sized in their own tables) and
``[verdict]`` (the floor and seeds of :func:`verdicts.paired_verdict`). A group of kind ``grid``
(``keel sweep``'s; the sweep presets of ``keel/configs/sweeps/`` are such files) takes ``grid``
(``{section.key: [values]}``), ``best_over``, ``match_params`` and ``set`` instead of schemes,
sub-layers, LRs and seeds. Config keys apply in the order scale ``set``, group ``set``, the
user's ``--set`` (later wins).

Every run is an ordinary ``keel train`` run (:func:`keel.experiments.sweep.train_task`):
finished runs are cached, interrupted ones resume (``--resume``), groups run in file order
(``--groups ramp,init`` trains only those, e.g. the cheap groups first).
Layout of ``--out``::

    OUT/<group>/<run>/          one training run (grid job: job.json, result.json, run.log, ...)
    OUT/<ramp group>/references/<run>/   the stress test's reference runs
    OUT/report.md, report.json  the verdicts, the per-claim tables, every run's numbers, a group kind's
                                own table (a grid group's sweep table; ``table = true``: a ramp
                                group's stress table, a train group's LR sensitivity)
    OUT/*.png                   loss against LR per group, the ramp, margins against depth, showcase

The verdict vocabulary is ``reproduced`` / ``not reproduced`` / ``inconclusive``, computed, never
written by hand, and each claim's one-line summary is written from those numbers
(:func:`report.claim_summary`; ``report.json``'s ``summary``):
by :func:`verdicts.paired_verdict` on paired per-seed differences for every
claim test but ``lr_transfer`` (:mod:`.claims.lr_transfer`), whose rule (same optimal grid point in every
seed) is its own.

Modules, each importing only those before it: :mod:`.ablation` (a group's measurements of its
trained models: layer importance, test-time loops), :mod:`.kinds` (one class per kind of group:
train, ramp, grid; its jobs, task, LR plan words, record and plot), :mod:`.spec` (the TOML as
:class:`spec.Study`, its groups checked), :mod:`.verdicts` (what several kinds' verdicts share:
combining parts, the init conditions, a bench's baseline margins), :mod:`.cells` (numbers as
markdown cells), :mod:`.claims` (a package, one module per kind of claim: its keys as a typed
class, its verdict, reads and tables; the registry :data:`claims.CLAIMS` each kind's class joins,
and :func:`claims.load_study`, which checks every claim and types it), :mod:`.records` (a run's
record, from its folder or restored), :mod:`.dataset` (the shared dataset, prepared once),
:mod:`.lrs` (a group's jobs and LR plan: transferred, widened until bracketed), :mod:`.report`
(``report.md`` and the PNGs), :mod:`.plan` (the dry-run estimate: planned jobs, rows, words),
:mod:`.judge` (the claims judged, the loss floor, ``report.json`` and the report's files written),
:mod:`.run` (the runs collected on the grid runner, and the driver, :func:`run.run_study` /
:func:`run.execute`).
"""
