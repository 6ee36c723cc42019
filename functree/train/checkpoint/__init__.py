"""functree's checkpoints: a tree's arrays and its description, written and read back.

Users reach them through :mod:`functree.train` (``ft.train.save``, ``ft.train.load``,
``ft.train.CheckpointManager``, ``ft.train.Checkpoint``, ``ft.train.CheckpointError``,
``ft.train.migrate``, ``ft.train.register``); this package holds their parts, one concern
a module:

* ``_checkpoint``: ``CheckpointManager``, ``save``/``load`` (a step's files, its digest);
* ``_treespec`` and ``_registry``: a tree <-> its JSON description (types by public name,
  never imported because a file names them);
* ``_decode``: a description read back into a tree without a template (classes looked up
  by name, an edited or ambiguous class, a static value only a template gives back);
* ``_errors``: ``CheckpointError``, ``SpecError`` and the damaged-description message;
* ``_template``: a part read against a template (key paths, shapes, dtypes, static values);
* ``_extra``: the ``extra`` part, entry by entry (``extra_template``, ``SKIP``), a Module of
  the model's class read like the model;
* ``_arrays``: arrays' checksums and placement (where a restored array goes);
* ``_directory``: the lock and the retention of steps; ``_processes``: multi-process saves;
* ``_frozen``: parameters a job does not train, stored as fingerprints;
* ``_position``: a data iterator's state as JSON; ``_migrate``: format 1 -> format 2.
"""

__all__: list[str] = []
