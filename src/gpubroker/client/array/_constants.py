"""The standard's constants: ``e``, ``inf``, ``nan``, ``pi`` (Python floats, as the standard has them) and
``newaxis`` (``None``, for indexing).

Libraries read them from the namespace, e.g. scikit-learn's ``MinMaxScaler`` (``xp.inf``) and ``GaussianNB``
(``xp.pi``).
"""

from __future__ import annotations

import math

__all__ = ["e", "inf", "nan", "newaxis", "pi"]

e: float = math.e
inf: float = math.inf
nan: float = math.nan
pi: float = math.pi
newaxis: None = None
