"""Model families: one object per kind of model that every stage asks instead of branching (docs/families.md).

>>> from bpd_train.families import family_of
>>> family_of({"arch": "lm"}).name, family_of({}).name
('lm', 'mt')
"""

from bpd_train.families import lm, mt  # noqa: F401 - each module registers its family
from bpd_train.families.base import ModelFamily, families, family_of, get_family, register

__all__ = ["ModelFamily", "families", "family_of", "get_family", "register"]
