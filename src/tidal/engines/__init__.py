"""Where a job's processes run. The default engine is Tidal's own agents
(``tidal agent``, one per node). :mod:`tidal.engines.ray` runs them on a Ray
cluster instead: one :class:`~tidal.agent.agent.Agent` per Ray node, in one
process, each starting its processes inside Ray actors pinned to its node.
Scheduling is unchanged: every decision is the server's."""

from __future__ import annotations

ENGINES = ("agents", "ray")
