"""The recorded name of the Hugging Face model classes, not their home (that is
:mod:`functree.hf._models`).

Checkpoints and pickles record those classes as ``functree.nn._hf_models.<name>``: they
were defined here before ``functree.hf`` existed, and the name is kept so that files
written before and after the move read both ways. A pickle imports the module it names,
so this module exists, re-exporting the classes; nothing in functree imports it. It is
the one module of ``ft.nn`` that points up at a package built on it
(``tests/test_imports.py`` names it as the exception).
"""

from functree.hf._models import *  # noqa: F403  (the recorded names: every class of RECORDED)
from functree.hf._models import __all__  # noqa: F401
