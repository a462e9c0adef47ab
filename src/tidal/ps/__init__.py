"""Parameter-server jobs: sharded dense and embedding tables on parameter
servers, workers that pull and push asynchronously (optionally with bounded
staleness), a master with dynamic data sharding, repartitioning without a lost
update, hot-server replacement and checkpoint/restore (docs/ps.md)."""

from tidal.ps.client import PSClient
from tidal.ps.launch import ProcessLauncher, ThreadLauncher
from tidal.ps.layout import Layout, TableSpec
from tidal.ps.master import PSMaster
from tidal.ps.repartition import HotDetector
from tidal.ps.shards import Shard, ShardQueue

__all__ = ["HotDetector", "Layout", "PSClient", "PSMaster", "ProcessLauncher", "Shard", "ShardQueue",
           "TableSpec", "ThreadLauncher"]
