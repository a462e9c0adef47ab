"""``tidal agent``: one per GPU node (the SideCar of the SideCar paper, §III-B).

It registers its node and GPUs (NVML through nvidia-ml-py when present,
``--virtual-gpus N`` otherwise), heart-beats to the server, and reconciles
the processes the server wants on this node (job masters and workers) with
the ones it runs: it launches them with ``CUDA_VISIBLE_DEVICES`` and the job's
environment, stops the ones no longer wanted, and ships their output and
exit codes back. When the server is unreachable it keeps every process
running and keeps retrying; a restarted server finds them again. Its process
table is kept on disk (:mod:`tidal.agent.proctable`): an agent restarted
after a crash adopts the processes still running instead of launching them
again, and reports those that ended meanwhile. A process that cannot be
launched (exec fails: E2BIG, ENOENT, EACCES, ...) is tried once and reported
failed with the reason; one row never holds up the others or the heartbeat.
Workers run inside the job's memory and CPU limits (:mod:`tidal.agent.limits`:
cgroup v2, v1 or an RSS watchdog); one killed for memory is reported as such
(docs/resources.md).
"""

from tidal.agent.agent import Agent, detect_gpus

__all__ = ["Agent", "detect_gpus"]
