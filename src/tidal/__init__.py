"""Tidal: elastic deep learning on shared GPU clusters.

Packages:
  tidal.core       job model, cluster topology, throughput profiles, overheads
  tidal.scheduler  pure scheduling policies (admission -> allocation -> placement)
  tidal.sim        trace loaders, discrete-event simulator, metrics and plots
  tidal.runtime    elastic PyTorch runtime (job master, workers, elastic data)
  tidal.cli        the ``tidal`` command
"""

__version__ = "0.1.0"
