"""Weight-space interference between task matrices (no data needed).

- :mod:`diagnostics.interference.metrics`: the pure equations (norms, effective
  rank, cosine, sign conflicts, STI, SAR, I(k), R(k)), each citing seed 003;
- :mod:`diagnostics.interference.driver`: :func:`interference`, which streams a
  checkpoint one matrix at a time into the store, and :func:`summarize_interference`.

Every public name of both (their ``__all__``) is re-exported here, e.g.
``from diagnostics.interference import interference, sti``.
"""

from diagnostics.interference import driver, metrics
from diagnostics.interference.driver import *
from diagnostics.interference.metrics import *

__all__ = metrics.__all__ + driver.__all__
