"""Everything that moves bytes, in three layers, each calling only the one below it:

* ``runners/``: execute a plan of the tier manager (store, load, spill), in order, and hand the
  outcome back to the manager to finish (plan and finish are the manager's, synchronous);
* ``handlers/``: one handler per (source medium, destination medium) and the ``Dispatcher`` that
  runs a job through it under the in-flight byte budget;
* ``engines/``: the copy engines between GPU blocks and CPU slots (host threads, CUDA streams).

The engines' names are re-exported here for code that drives copies directly.
"""

from . import engines
from .engines import *  # noqa: F403 - the engines' names, for code that drives copies directly

__all__ = engines.__all__
