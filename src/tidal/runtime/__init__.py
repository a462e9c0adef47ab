"""Tidal's elastic runtime: stop-free rescaling of plain PyTorch jobs with
exactly-once data and fixed-run equivalence. See ``docs/runtime.md``.

Worker side: :func:`init`, :class:`Job`, :class:`ElasticState`.
Job master: :class:`JobMaster`, :class:`MasterServer`, :class:`MasterClient`.
Operations: :func:`profile` (a job's scaling curve), :func:`assign_sources`
(who sends newcomers their state).
"""

from tidal.runtime.client import MasterClient, MasterUnavailable
from tidal.runtime.data import ElasticBatchIterator, ShardManager, ShardReader, epoch_permutation, split_sizes, step_slice
from tidal.runtime.master import JobMaster
from tidal.runtime.server import MasterServer
from tidal.runtime.messages import Generation, SwitchPlan, ScaleAnswer, Status
from tidal.runtime.reducer import GradReducer
from tidal.runtime.persistence import StateBackend, open_backend, register_backend
from tidal.runtime.profiling import ProfileResult, profile
from tidal.runtime.replication import Location, assign_sources
from tidal.runtime.scaling import BatchPolicy, HybridScaling, StrongScaling, WeakScaling, make_policy
from tidal.runtime.state import ElasticState
from tidal.runtime.worker import Job, init

__all__ = [
    "BatchPolicy", "ElasticBatchIterator", "Location", "ProfileResult", "assign_sources", "profile", "ElasticState", "Generation", "GradReducer", "HybridScaling", "Job", "JobMaster",
    "MasterClient", "MasterServer", "MasterUnavailable", "SwitchPlan", "ScaleAnswer", "ShardManager", "ShardReader", "StateBackend",
    "Status", "StrongScaling", "WeakScaling", "epoch_permutation", "init", "make_policy", "open_backend",
    "register_backend", "split_sizes", "step_slice",
]
