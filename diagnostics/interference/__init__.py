"""Weight-space interference between task matrices (no data needed).

- :mod:`submerge.diagnostics.interference.metrics`: the pure equations (norms, effective
  rank, cosine, sign conflicts, STI, SAR, I(k), R(k)), each citing seed 003;
- :mod:`submerge.diagnostics.interference.gram`: the same figures through the task matrices' Gram
  matrices (the default route of :func:`task_matrix_interference`; ``exact_svd=True``: full SVDs);
- :mod:`submerge.diagnostics.interference.driver`: :func:`interference`, which streams a
  checkpoint one matrix at a time into the store, and the group's owner ``INTERFERENCE`` (its layout, summary
  table and figures; :func:`matrix_table` has one row per matrix).

Every public name of both (their ``__all__``) is re-exported here, e.g.
``from submerge.diagnostics.interference import interference, sti``.
"""

from submerge.diagnostics.interference import driver, metrics
from submerge.diagnostics.interference.driver import *
from submerge.diagnostics.interference.metrics import *

__all__ = metrics.__all__ + driver.__all__
