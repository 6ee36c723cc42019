"""The recorded name of :class:`functree.hf._config.HFConfig` (a ``from_hf`` model's config),
not its home.

Pickles record the class as ``functree.nn._hf_config.HFConfig``: it was defined here before
``functree.hf`` existed, and the name is kept so that pickles written before and after the
move read both ways (as ``_hf_models.py`` for the model classes). A pickle imports the
module it names, so this module exists; nothing in functree imports it.
"""

from functree.hf._config import HFConfig

__all__ = ["HFConfig"]
