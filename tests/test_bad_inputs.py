"""The first hours' mistakes, as a corpus: every bad input to the CLI
(simulate, run, up, server, submit, scale, migrate, profile, jobs, job, logs,
user, cluster, demo, ...), to its files (YAML/JSON job specs, cluster CSVs,
trace CSVs), to its environment (an unusable $TIDAL_HOME, a full disk, a
port in use) and to the HTTP API gets one clear answer naming the input and
what is wrong: a non-zero exit (or a 4xx), no traceback, no hang, nothing
half-written. Ctrl-C in each long-running command is tried on a real
process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tidal import settings
from tidal.cli.main import app
from tidal.control.local import LocalCluster, free_port

runner = CliRunner()
DEAD = f"http://127.0.0.1:{free_port()}"  # nothing listens there
HOME = settings.HOME.name
ROOT = Path(__file__).resolve().parents[1]
SUB = ["submit", "--name", "a", "--script", "x.py"]  # a submission's start; the case adds the rest
ITP = "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu\n"

# (arguments, a phrase the one error line must contain[, environment]); placeholders: {d} a directory of bad
# files, {t} a small trace, {p} a port another process listens on, {f} a directory on a full disk
OFFLINE = [
    # simulate: options
    (["simulate"], "Missing option '--trace'"),
    (["simulate", "--trace", "{d}/none.csv"], "trace file does not exist"),
    (["simulate", "--trace", "{d}/garbage.csv"], "unknown trace format"),
    (["simulate", "--trace", "{d}/x[/y].csv"], "unknown trace format"),
    (["simulate", "--trace", "{d}/binary.csv"], "not a readable CSV file"),
    (["simulate", "--trace", "{d}/empty.csv"], "empty"),
    (["simulate", "--trace", ""], "--trace '': give a trace file"),
    (["simulate", "--trace", "{d}"], "trace path is a directory"),
    (["simulate", "--trace", "{t}", "--cluster", "n0g8"], "at least one node"),
    (["simulate", "--trace", "{t}", "--cluster", "banana"], "not a cluster spec"),
    (["simulate", "--trace", "{t}", "--cluster", "n4g8s3"], "do not divide"),
    (["simulate", "--trace", "{t}", "--cluster", "6xT4:0"], "needs at least one node and one GPU"),
    (["simulate", "--trace", "{t}", "--cluster", "6xT4:4,banana"], "not a node group like '6xT4:4'"),
    (["simulate", "--trace", "{t}", "--cluster", "2xA100:8,4x4", "--fidelity", "artifact"], "mixes node sizes"),
    (["simulate", "--trace", "{t}", "--cluster", "{d}/none-cluster.csv"], "not a cluster spec"),
    (["simulate", "--trace", "{t}", "--cluster", ""], "field 'cluster': empty"),
    (["simulate", "--trace", "{t}", "--policy", "nope"], "unknown policy nope"),
    (["simulate", "--trace", "{t}", "--policy", ","], "unknown policy"),
    (["simulate", "--trace", "{t}", "--policy", "tiresas"], "unknown policy tiresas; did you mean tiresias?"),
    (["simulate", "--trace", "{t}", "--policy", "fifo,edff"], "unknown policy edff; did you mean edf?"),
    (["simulate", "--trace", "{t}", "--slot", "-5"], "--slot"),
    (["simulate", "--trace", "{t}", "--slot", "1e12"], "'--slot': 1e+12: must be at most 86400 s"),
    (["simulate", "--trace", "{t}", "--slot", "86401"], "'--slot': 86401: must be at most 86400 s"),
    (["simulate", "--trace", "{t}", "--slot", "nan"], "'--slot': nan: give a finite number"),
    (["simulate", "--trace", "{t}", "--slot", "inf"], "'--slot': inf: give a finite number"),
    (["simulate", "--trace", "{t}", "--slot", "x"], "--slot"),
    (["simulate", "--trace", "{t}", "--limit", "-3"], "field 'limit'"),
    (["simulate", "--trace", "{t}", "--limit", "0"], "field 'limit'"),
    (["simulate", "--trace", "{t}", "--limit", "x"], "--limit"),
    (["simulate", "--trace", "{t}", "--limit", "1e3"], "--limit"),
    (["simulate", "--trace", "{t}", "--overhead", "magic"], "overhead mode"),
    (["simulate", "--trace", "{t}", "--overhead", ""], "overhead mode"),
    (["simulate", "--trace", "{t}", "--format", "xml"], "unknown trace format 'xml'"),
    (["simulate", "--trace", "{t}", "--format", ""], "unknown trace format ''"),
    (["simulate", "--trace", "{t}", "--profiles", "{d}/none"], "profile directory does not exist"),
    (["simulate", "--trace", "{t}", "--profiles", "{d}/ok.py"], "ok.py: not a directory"),
    (["simulate", "--trace", "{t}", "--seed", "x"], "--seed"),
    (["simulate", "--trace", "{t}", "--fidelity", "exact"], "--fidelity: choose tidal or artifact"),
    # simulate: where the results go
    (["simulate", "--trace", "{t}", "--out", "{d}/ok.py"], "--out {d}/ok.py: exists and is not a directory"),
    (["simulate", "--trace", "{t}", "--out", "{d}/ok.py/sub"], "{d}/ok.py is a file"),
    (["simulate", "--trace", "{t}", "--out", "/proc/tidal-out"], "--out /proc/tidal-out: cannot write in /proc"),
    (["simulate", "--trace", "{t}", "--out", "/sys/tidal-out"], "--out /sys/tidal-out: cannot write in /sys"),
    (["simulate", "--trace", "{t}", "--out", "{f}/out"], "--out {f}/out: cannot write"),
    (["simulate", "--trace", "{t}", "--out", "{f}/out", "--report"], "No space left on device"),
    # simulate: trace files
    (["simulate", "--trace", "{d}/big.csv"], "job 'big' asks for 100000 GPUs, but cluster n32g8 has 256"),
    (["simulate", "--trace", "{d}/big.csv", "--cluster", "n1g8"], "asks for 100000 GPUs (and 1 more)"),
    (["simulate", "--trace", "{d}/dup-id.csv"], "duplicate job id"),
    (["simulate", "--trace", "{d}/neg-iter.csv"], "field 'num_iteration': must be > 0"),
    (["simulate", "--trace", "{d}/early-ddl.csv"], "is before submit time"),
    (["simulate", "--trace", "{d}/zero-gpu.csv"], "field 'num_gpu': must be >= 1"),
    (["simulate", "--trace", "{d}/zero-batch.csv"], "field 'batch_size': must be > 0"),
    (["simulate", "--trace", "{d}/header-only.csv"], "no data rows"),
    (["simulate", "--trace", "{d}/word-gpu.csv"], "num_gpu"),
    (["simulate", "--trace", "{d}/no-model.csv"], "model_name"),
    # simulate: cluster files
    (["simulate", "--trace", "{t}", "--cluster", "{d}/hello.csv"], "line 1: not a cluster CSV"),
    (["simulate", "--trace", "{t}", "--cluster", "{d}/header-cluster.csv"], "line 2: no data row under the header"),
    (["simulate", "--trace", "{t}", "--cluster", "{d}/word-cluster.csv"], "field 'num_gpu_p_node': not an integer"),
    (["simulate", "--trace", "{t}", "--cluster", "{d}/zero-cluster.csv"], "field 'num_switch': must be >= 1"),
    (["simulate", "--trace", "{t}", "--cluster", "{d}/binary.csv"], "not a readable cluster CSV file"),
    (["simulate", "--trace", "{t}", "--cluster", "{d}"], "a directory, not a cluster CSV file"),
    (["simulate", "--trace", "{t}", "--cluster", "{d}/empty.csv"], "line 1: not a cluster CSV"),
    # run
    (["run"], "Missing argument"),
    (["run", "{d}/none.py"], "no such script"),
    (["run", "{d}"], "no such script"),
    (["run", "--workers", "0", "{d}/ok.py"], "--workers must be at least 1"),
    (["run", "--workers", "-1", "{d}/ok.py"], "--workers must be at least 1"),
    (["run", "--workers", "x", "{d}/ok.py"], "--workers"),
    (["run", "--workers", "4", "--max-workers", "2", "{d}/ok.py"], "more than --max-workers"),
    (["run", "--max-workers", "0", "{d}/ok.py"], "'--max-workers': 0: must be at least 1"),
    (["run", "--max-steps", "0", "{d}/ok.py"], "--max-steps"),
    (["run", "--state", "bogus://x", "{d}/ok.py"], "unknown state backend"),
    (["run", "--state", "sqlite:///no/such/dir/x.db", "{d}/ok.py"], "the folder /no/such/dir does not exist"),
    (["run", "--state", "sqlite://{d}/ok.py/x.db", "{d}/ok.py"], "{d}/ok.py is not a folder"),
    (["run", "--state", "", "{d}/ok.py"], "--state '': give a file path"),
    (["run", "--state", "file://{d}", "{d}/ok.py"], "is a directory; give a file path in it"),
    (["run", "--state", "file:///proc/x/state.json", "{d}/ok.py"], "cannot write in /proc"),
    (["run", "--join", "nohostport", "{d}/ok.py"], "expected HOST:PORT"),
    (["run", "--join", "127.0.0.1:99999", "{d}/ok.py"], "not a TCP port"),
    (["run", "--join", DEAD.removeprefix("http://"), "--timeout", "3", "{d}/ok.py"], "no job master answers"),
    (["run", "--port", "70000", "{d}/ok.py"], "--port"),
    (["run", "--port", "-1", "{d}/ok.py"], "--port"),
    (["run", "--port", "{p}", "{d}/ok.py"], "--port {p}: in use by another process"),
    (["run", "--bind", "999.1.1.1", "{d}/ok.py"], "--bind 999.1.1.1: not an IP address or a known host name"),
    (["run", "--bind", "", "{d}/ok.py"], "--bind '': give an IP address"),
    (["run", "--bind", "192.0.2.1", "{d}/ok.py"], "--bind 192.0.2.1: not an address of this host"),
    (["run", "--bind", "no-such-host.invalid", "{d}/ok.py"], "not an IP address or a known host name"),
    (["run", "--bind", "::1", "{d}/ok.py"], "--bind ::1: give an IPv4 address"),
    (["run", "--advertise-addr", "", "{d}/ok.py"], "--advertise-addr '': give an address"),
    (["run", "--timeout", "-1", "{d}/ok.py"], "'--timeout': -1: must be more than 0 s"),
    (["run", "--timeout", "0", "{d}/ok.py"], "'--timeout': 0: must be more than 0 s"),
    (["run", "--timeout", "nan", "{d}/ok.py"], "'--timeout': nan: give a finite number"),
    (["run", "--hang-timeout", "-5", "{d}/ok.py"], "'--hang-timeout': -5: must be at least 0 s"),
    (["run", "--hang-timeout", "inf", "{d}/ok.py"], "'--hang-timeout': inf: give a finite number"),
    (["run", "--switch-lead", "-3", "{d}/ok.py"], "'--switch-lead': -3: must be at least 0 s"),
    (["run", "--switch-lead", "nan", "{d}/ok.py"], "'--switch-lead': nan: give a finite number"),
    (["run", "--job", "", "{d}/ok.py"], "--job '': give a name"),
    (["run", "--job", " ", "{d}/ok.py"], "--job ' ': give a name"),
    (["run", "--job", "a/b", "{d}/ok.py"], "--job 'a/b': a name has no slashes"),
    (["run", "--job", "..", "{d}/ok.py"], "--job '..': a name has no slashes"),
    (["run", "--straggler-policy", "zap", "{d}/ok.py"], "--straggler-policy"),
    (["run", "--replication", "zap", "{d}/ok.py"], "--replication"),
    (["run", "{d}/ok.py"], "exists and is not a directory", {HOME: "{d}/ok.py"}),
    (["run", "{d}/ok.py"], "state directory /proc/tidal-home", {HOME: "/proc/tidal-home"}),
    (["run", "{d}/ok.py"], "is a file, so no directory", {HOME: "{d}/ok.py/home"}),
    (["run", "{d}/ok.py"], "No space left on device", {HOME: "{f}/home"}),
    # scale, migrate, profile (`tidal run` jobs)
    (["scale"], "Missing argument"),
    (["scale", "x", "-2"], "No such option"),
    (["scale", "x", "two"], "gpus"),
    (["scale", "x"], "give either N"),
    (["scale", "nojob", "--workers", "2"], "no running job 'nojob'"),
    (["scale", "nojob", "--remove-host", "h1"], "no running job 'nojob'"),
    (["scale", "nojob", "--workers", "2", "--timeout", "0"], "'--timeout': 0: must be more than 0 s"),
    (["scale", "nojob", "--workers", "2", "--timeout", "nan"], "'--timeout': nan: give a finite number"),
    (["migrate", "nojob", "0"], "no running job 'nojob'"),
    (["migrate"], "Missing argument"),
    (["migrate", "nojob", "x"], "ranks"),
    (["migrate", "nojob", "0", "--timeout", "-1"], "'--timeout': -1: must be more than 0 s"),
    (["profile"], "Missing argument"),
    (["profile", "nojob", "--max", "2", "--batch", "8"], "no running job 'nojob'"),
    (["profile", "nojob", "--max", "2", "--batch", "0"], "'--batch': 0: must be at least 1"),
    (["profile", "nojob", "--max", "0", "--batch", "8"], "'--max': 0: must be at least 1"),
    (["profile", "nojob", "--max", "2", "--batch", "8", "--min", "0"], "'--min': 0: must be at least 1"),
    (["profile", "nojob", "--max", "2", "--batch", "8", "--steps", "0"], "'--steps': 0: must be at least 1"),
    (["profile", "nojob", "--max", "2", "--batch", "8", "--out", "{d}/ok.py"], "--out {d}/ok.py: exists and is not"),
    (["profile", "nojob", "--max", "2", "--batch", "8", "--out", "/proc/p"], "--out /proc/p: cannot write in /proc"),
    # up
    (["up", "--nodes", "0"], "--nodes 0: need at least 1"),
    (["up", "--nodes", "-2"], "--nodes -2: need at least 1"),
    (["up", "--gpus", "0"], "--gpus 0: need at least 1"),
    (["up", "--gpus", "-8"], "--gpus -8: need at least 1"),
    (["up", "--gpus", "3", "--nodes", "2"], "--gpus 3 does not divide into 2 nodes"),
    (["up", "--policy", "tiresas"], "--policy tiresas: unknown policy; did you mean tiresias?"),
    (["up", "--policy", ""], "--policy : unknown policy"),
    (["up", "--port", "0"], "--port 0: a port is 1-65535"),
    (["up", "--port", "70000"], "--port 70000: a port is 1-65535"),
    (["up", "--port", "{p}"], "--port {p}: in use"),
    (["up", "--home", "{d}/ok.py"], "--home {d}/ok.py: exists and is not a directory"),
    (["up", "--home", "/proc/tidal-home"], "--home /proc/tidal-home: cannot write in /proc"),
    (["up", "--home", "{d}/ok.py/h"], "{d}/ok.py is a file"),
    (["up", "--home", "{f}/home"], "--home {f}/home: cannot write there (No space left on device)"),
    (["up"], "{d}/ok.py: exists and is not a directory", {HOME: "{d}/ok.py"}),
    # server, agent, agent-token
    (["server", "--policy", "nope"], "--policy nope: unknown policy"),
    (["server", "--policy", "tiresas"], "did you mean tiresias?"),
    (["server", "--port", "99999"], "--port"),
    (["server", "--port", "{p}"], "--port {p}: in use"),
    (["server", "--host", "999.1.1.1"], "--host 999.1.1.1: not an IP address"),
    (["server", "--host", "192.0.2.1"], "--host 192.0.2.1: not an address of this host"),
    (["server", "--tick", "0"], "--tick 0: must be more than 0 s"),
    (["server", "--tick", "-1"], "--tick -1: must be more than 0 s"),
    (["server", "--tick", "nan"], "--tick nan: give a finite number"),
    (["server", "--tick", "1e9"], "--tick 1e+09: must be at most 3600 s"),
    (["server", "--tls-cert", "{d}/none.pem", "--tls-key", "{d}/none.key"], "no such file"),
    (["server", "--tls-cert", "{d}/ok.py"], "together"),
    (["server", "--tls-cert", "{d}", "--tls-key", "{d}"], "{d}: a directory, not a PEM file"),
    (["server", "--db", "sqlite:////no/such/dir/t.db", "--port", "{q}"], "the folder /no/such/dir does not exist"),
    (["server", "--db", "sqlite:///{d}", "--port", "{q}"], "is a directory; give a file path in it"),
    (["server", "--db", "nonsense", "--port", "{q}"], "--db 'nonsense': not a database URL"),
    (["server", "--db", "sqlite:////proc/t.db", "--port", "{q}"], "cannot write in /proc"),
    (["server", "--engine", "slurm", "--port", "{q}"], "unknown engine 'slurm'"),
    (["server", "--port", "{q}"], "state directory {d}/ok.py", {HOME: "{d}/ok.py"}),
    (["server", "--port", "{q}"], "state directory /proc/tidal-home", {HOME: "/proc/tidal-home"}),
    (["server", "--port", "{q}"], "No space left on device", {HOME: "{f}/home"}),
    (["agent", "--virtual-gpus", "0"], "--virtual-gpus"),
    (["agent", "--virtual-gpus", "2", "--gpu-type", "8bad"], "--gpu-type '8bad'"),
    (["agent", "--virtual-gpus", "1", "--label", "rack1"], "expected KEY=VALUE"),
    (["agent-token", "--home", "{d}/ok.py"], "--home {d}/ok.py: exists and is not a directory"),
    (["agent-token", "--home", "/proc/tidal-home"], "cannot write in /proc"),
    (["agent-token", "--home", "{f}/home"], "No space left on device"),
    (["agent-token"], "state directory /proc/tidal-home", {HOME: "/proc/tidal-home"}),
    # submit: flags and spec files (checked before any server is asked)
    (["submit"], "field 'name'"),
    (["submit", "{d}/none.yaml"], "no such file"),
    (["submit", "{d}/broken.yaml"], "not valid YAML"),
    (["submit", "{d}/markup.yaml"], "field 'name'"),
    (["submit", "{d}/noiter.yaml"], "give iterations or epochs"),
    (["submit", "{d}/binary.yaml"], "not a text (UTF-8) file"),
    (["submit", "{d}/list.yaml"], "mapping"),
    (["submit", "{d}/dup.yaml"], "dup.yaml, line 4: the key 'gpus' is given twice (first at line 3)"),
    (["submit", "{d}/dup-nested.yaml"], "the key 'memory' is given twice"),
    (["submit", "{d}/dup.json"], "dup.json, line 1: the key 'name' is given twice"),
    (["submit", "{d}/automatic.yaml"], "'automatic' is not a resource request: write `resources: auto`"),
    (["submit", "{d}"], "a directory, not a spec file"),
    (["submit", "{d}/broken.json"], "not valid YAML"),
    (["submit", "{d}/list.json"], "mapping"),
    (["submit", "{d}/colour.json"], "field 'colour'"),
    (["submit", "{d}/range.yaml"], "field 'gpus'"),
    (["submit", "{d}/spaces.yaml"], "field 'name'"),
    (["submit", "{d}/env-list.yaml"], "field 'env'"),
    (["submit", "{d}/epochs.yaml"], "epochs needs dataset_size"),
    (["submit", "{d}/minmax.yaml"], "min_gpus > max_gpus"),
    (["submit", "{d}/memory.yaml"], "field 'resources.memory'"),
    (["submit", "{d}/cpus.yaml"], "field 'resources.cpus'"),
    ([*SUB, "--gpus", "0", "--iterations", "5"], "field 'gpus'"),
    ([*SUB, "--gpus", "8-2", "--iterations", "5"], "field 'gpus'"),
    ([*SUB, "--gpus", "abc", "--iterations", "5"], "field 'gpus'"),
    ([*SUB, "--gpus", "1,x", "--iterations", "5"], "field 'gpus'"),
    ([*SUB, "--gpus", "-2", "--iterations", "5"], "field 'gpus'"),
    ([*SUB, "--gpus", "", "--iterations", "5"], "field 'gpus'"),
    ([*SUB, "--gpus", "1e40", "--iterations", "5"], "field 'gpus'"),
    ([*SUB, "--gpus", "2", "--iterations", "-5"], "field 'iterations'"),
    ([*SUB, "--gpus", "2", "--iterations", "0"], "field 'iterations'"),
    ([*SUB, "--gpus", "2", "--iterations", "5", "--deadline", "-1"], "field 'deadline'"),
    ([*SUB, "--gpus", "2", "--iterations", "5", "--deadline", "nan"], "field 'deadline'"),
    ([*SUB, "--gpus", "2", "--iterations", "5", "--deadline", "1e12"], "field 'deadline'"),
    (["submit", "--name", "", "--script", "x.py", "--gpus", "2", "--iterations", "5"], "field 'name'"),
    (["submit", "--name", "a b", "--script", "x.py", "--gpus", "2", "--iterations", "5"], "field 'name'"),
    (["submit", "--name", "a", "--script", "", "--gpus", "2", "--iterations", "5"], "field 'script'"),
    ([*SUB, "--gpus", "2", "--iterations", "5", "--batch-size", "0"], "field 'global_batch_size'"),
    ([*SUB, "--gpus", "2"], "give iterations or epochs"),
    ([*SUB, "--gpus", "2", "--iterations", "5", "--gpu-type", ""], "field 'gpu_types': an empty GPU type name"),
    ([*SUB, "--gpus", "2", "--iterations", "5", "--gpu-type", "8x"], "'8x' is not a GPU type name"),
    ([*SUB, "--gpus", "2", "--iterations", "5", "--gpu-type", "A100", "--exclude-gpu-type", "A100"],
     "GPU type A100 is both in gpu_types and in exclude_gpu_types"),
    (["submit", "{d}/types-both.yaml"], "give gpu_types or gpu_type (the same key), not both"),
    (["submit", "{d}/types-empty.yaml"], "field 'exclude_gpu_types': an empty GPU type name"),
    # the live-cluster commands
    (["user"], "Missing argument"),
    (["user", ""], "must not be empty"),
    (["logs"], "Missing argument"),
    (["jobs", "-o", "xml"], "choose one of"),
    (["cluster", "-o", "xml"], "choose one of"),
    (["job", "x", "-o", "xml"], "choose one of"),
    (["job"], "Missing argument"),
    (["cancel"], "Missing argument"),
    (["jobs", "--server", DEAD], "cannot reach the server"),
    (["job", "x", "--server", DEAD], "cannot reach the server"),
    (["logs", "x", "--server", DEAD], "cannot reach the server"),
    (["cluster", "--server", DEAD], "cannot reach the server"),
    (["cancel", "x", "--server", DEAD], "cannot reach the server"),
    (["user", "bob", "--server", DEAD], "cannot reach the server"),
    (["scale", "x", "2", "--server", DEAD], "cannot reach the server"),
    (["demo", "--seed", "x"], "--seed"),
    (["demo", "--sim", "--jobs", "0"], "--jobs"),
    (["demo", "--sim", "--cluster", "banana"], "banana"),
    (["nosuchcommand"], "No such command"),
]


def _write_bad_files(d: Path) -> None:
    (d / "garbage.csv").write_text("garbage,,\n1,2\n")
    (d / "x[").mkdir()
    (d / "x[" / "y].csv").write_text("[/bold],x\n")
    (d / "binary.csv").write_bytes(bytes(range(256)) * 4)
    (d / "empty.csv").write_text("")
    (d / "ok.py").write_text("print('ok')\n")
    (d / "tiny.csv").write_text(ITP + "1,0,100,resnet50,3600,256,2\n")
    rows = {"big.csv": "big,0,100,resnet50,3600,256,100000\nbig2,0,100,resnet50,3600,256,9\n",
            "dup-id.csv": "a,0,100,resnet50,3600,256,2\na,5,100,resnet50,3600,256,2\n",
            "neg-iter.csv": "a,0,-100,resnet50,3600,256,2\n", "early-ddl.csv": "a,100,100,resnet50,50,256,2\n",
            "zero-gpu.csv": "a,0,100,resnet50,3600,256,0\n", "zero-batch.csv": "a,0,100,resnet50,3600,0,2\n",
            "header-only.csv": "", "word-gpu.csv": "a,0,100,resnet50,3600,256,two\n",
            "no-model.csv": "a,0,100,no-such-model,3600,256,2\n"}
    for name, body in rows.items():
        (d / name).write_text(ITP + body)
    head = "num_switch,num_node_p_switch,num_gpu_p_node\n"
    for name, body in {"hello.csv": "hello\n", "header-cluster.csv": head, "word-cluster.csv": head + "1,4,eight\n",
                       "zero-cluster.csv": head + "0,4,8\n"}.items():
        (d / name).write_text(body)
    job = "name: a\nscript: t.py\niterations: 5\n"
    specs = {"broken.yaml": "{bad yaml", "markup.yaml": 'name: ["[/x]"]\nscript: t.py\ngpus: 2\niterations: 5\n',
             "noiter.yaml": "name: x\nscript: t.py\ngpus: 2\n", "list.yaml": "- a\n- b\n",
             "noscript.yaml": "name: x\nscript: missing.py\ngpus: 2\niterations: 5\n",
             "dup.yaml": "name: a\nscript: t.py\ngpus: 2\ngpus: 4\niterations: 5\n",
             "dup-nested.yaml": job + "resources:\n  memory: 1Gi\n  memory: 2Gi\n",
             "dup.json": '{"name": "a", "script": "t.py", "name": "b", "iterations": 5}',
             "automatic.yaml": job + "resources: automatic\n", "broken.json": '{"name": "a",',
             "list.json": "[1, 2]", "colour.json": '{"name": "a", "script": "t.py", "iterations": 5, "colour": 1}',
             "range.yaml": job + "gpus: 8-2\n", "spaces.yaml": "name: a b\nscript: t.py\niterations: 5\n",
             "env-list.yaml": job + "env: [1, 2]\n", "epochs.yaml": "name: a\nscript: t.py\nepochs: 2\n",
             "minmax.yaml": job + "min_gpus: 4\nmax_gpus: 2\n", "memory.yaml": job + "resources: {memory: lots}\n",
             "cpus.yaml": job + "resources: {cpus: -1}\n",
             "types-both.yaml": job + "gpu_type: A100\ngpu_types: [V100]\n",
             "types-empty.yaml": job + "exclude_gpu_types: [T4, '']\n"}
    for name, body in specs.items():
        (d / name).write_text(body)
    (d / "binary.yaml").write_bytes(bytes(range(256)))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    _write_bad_files(d)
    return d


@pytest.fixture(scope="module")
def busy_port():
    """A port another process (a socket of this one) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    """A directory on a full file system: a 64 KiB tmpfs filled up (needs
    root; None where it cannot be mounted)."""
    d = tmp_path_factory.mktemp("full")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True).returncode:
        yield None
        return
    try:
        with contextlib.suppress(OSError), open(d / "filler", "wb") as fh:
            fh.write(b"\0" * (1 << 20))
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _fill(text: str, subs: dict[str, str]) -> str:
    for key, value in subs.items():
        text = text.replace("{" + key + "}", value)
    return text


def _one_clear_error(res, phrase: str) -> list[str]:
    """What is wrong with ``res`` as the answer to a bad input (empty: nothing)."""
    problems = []
    if res.exit_code == 0:
        problems.append("exit code 0")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        problems.append(f"exception {res.exception!r}")
    lines = [" ".join(line.strip(" │╭╮╰╯─").split()) for line in res.output.splitlines()]
    if not any(phrase in line for line in lines):
        problems.append(f"no line says {phrase!r}")
    if "Traceback" in res.output or len([x for x in lines if x]) > 12:
        problems.append("a traceback or a wall of text")
    return problems


def _leftovers(*dirs: Path | None) -> list[str]:
    """Files a failed command left: any file in its working folder, any .tmp anywhere."""
    out = []
    for d in dirs:
        if d is not None:
            out += [str(p) for p in d.rglob("*") if p.is_file() and (d.name == "cwd" or p.suffix == ".tmp")]
    return out


def _case_id(case) -> str:
    args = [a.replace(DEAD.removeprefix("http://"), "DEAD") for a in case[0]]  # ids equal in every xdist worker
    return "-".join(a.replace("/", "_")[:20] for a in args[:4]) + ("-env" if len(case) > 2 else "")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", OFFLINE, ids=[_case_id(c) for c in OFFLINE])
def test_every_bad_cli_input_gets_one_clear_error(case, bad_files, busy_port, full_dir, tmp_path, monkeypatch):
    """In-process (CliRunner): fast, and a traceback shows as an exception."""
    args, phrase, *env = case
    text = " ".join([*args, phrase, *(env[0].values() if env else [])])
    if "{f}" in text and full_dir is None:
        pytest.skip("no full file system here (mounting a tmpfs needs root)")
    subs = {"d": str(bad_files), "t": str(bad_files / "tiny.csv"), "p": str(busy_port), "q": str(free_port()),
            "f": str(full_dir)}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(HOME, str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "300")  # long paths on one line
    for key, value in (env[0] if env else {}).items():
        monkeypatch.setenv(key, _fill(value, subs))
    res = runner.invoke(app, [_fill(a, subs) for a in args])
    assert _one_clear_error(res, _fill(phrase, subs)) == [], res.output
    assert _leftovers(cwd, bad_files, full_dir) == []


# -- against a running server (no agents) -------------------------------------------
ONLINE = [
    (["user", "b;ob"], "user name"),
    (["user", "zed"], "409"),
    (["submit", "--name", "a", "--script", "-c", "--gpus", "2", "--iterations", "5"], "interpreter option"),
    (["submit", "--name", "a", "--script", "{d}/ok.py", "--gpus", "64", "--iterations", "5"], "GPU"),
    (["submit", "--name", "a", "--script", "{d}/ok.py", "--gpus", "9-12", "--iterations", "5"], "GPU"),
    # the server is on this host: a script that is not here cannot be where its agents are
    (["submit", "--name", "a", "--script", "{d}/nope.py", "--gpus", "2", "--iterations", "5"],
     "field 'script': {d}/nope.py does not exist"),
    (["submit", "{d}/noscript.yaml"], "field 'script': {d}/missing.py does not exist"),
    (["submit", "--name", "a", "--script", "{d}", "--gpus", "2", "--iterations", "5"],
     "field 'script': {d} is not a readable file"),
    (["scale", "nojob", "3"], "no job nojob"),
    (["logs", "nojob"], "no job nojob"),
    (["logs", "nojob", "-f"], "no job nojob"),
    (["cancel", "nojob"], "no job nojob"),
    (["job", "nojob"], "no job nojob"),
    (["job", "nojob", "-o", "json"], "no job nojob"),
    (["jobs", "--token", "wrong"], "401"),
    (["cluster", "--token", "wrong"], "401"),
    (["logs", "{j}", "--worker", "w99"], "--worker w99: job {j} has no process 'w99'; its processes: none yet"),
    (["logs", "{j}", "--worker", "master2"], "has no process 'master2'"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tidal.httpjson import JsonHttp

    c = LocalCluster(tmp_path_factory.mktemp("badsrv"), policy="fifo")
    c.start_server()
    # an 8-GPU node (no agent behind it): submissions are checked against the cluster's size
    JsonHttp(c.url, token=c.admin_token).call("POST", "/internal/agents/register", {"name": "n0", "num_gpus": 8})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def user_token(server) -> str:
    return runner.invoke(app, ["user", "zed", "--server", server.url, "--token", server.admin_token]).stdout.strip()


@pytest.fixture(scope="module")
def queued_job(server, user_token, bad_files) -> str:
    """A job that waits: a first one holds all 8 GPUs (fifo keeps the second queued)."""
    from tidal.httpjson import JsonHttp

    http = JsonHttp(server.url, token=user_token)
    body = {"name": "q", "script": str(bad_files / "ok.py"), "gpus": 8, "iterations": 10**6}
    http.call("POST", "/v1/jobs", body)
    status, ans = http.call("POST", "/v1/jobs", body)
    assert status in (200, 201), ans
    return ans["id"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ONLINE, ids=[_case_id(c) for c in ONLINE])
def test_bad_requests_to_a_running_server_get_a_clear_answer(case, server, user_token, queued_job, bad_files,
                                                             monkeypatch):
    args, phrase = case
    monkeypatch.setenv("COLUMNS", "300")
    subs = {"d": str(bad_files), "j": queued_job}
    args = [_fill(a, subs) for a in args]
    token = server.admin_token if args[0] == "user" else user_token
    argv = [*args, "--server", server.url] + ([] if "--token" in args else ["--token", token])
    res = runner.invoke(app, argv)
    assert _one_clear_error(res, _fill(phrase, subs)) == [], res.output


# (method, path, body, expected status[, "admin": sent with the admin token, "none": with no token])
OK = {"name": "a", "script": "x.py", "gpus": "2", "iterations": 5}
HTTP = [
    ("POST", "/v1/jobs", {**OK, "iterations": None, "epochs": float("inf")}, 422),
    ("POST", "/v1/jobs", {**OK, "iterations": -1}, 422),
    ("POST", "/v1/jobs", {**OK, "iterations": 0}, 422),
    ("POST", "/v1/jobs", {**OK, "iterations": 10**13}, 422),
    ("POST", "/v1/jobs", {**OK, "iterations": "many"}, 422),
    ("POST", "/v1/jobs", {**OK, "priority": 1e300}, 422),
    ("POST", "/v1/jobs", {**OK, "priority": "high"}, 422),
    ("POST", "/v1/jobs", {**OK, "gpus": "1e40"}, 422),
    ("POST", "/v1/jobs", {**OK, "gpu_types": [""]}, 422),
    ("POST", "/v1/jobs", {**OK, "gpu_types": ["A100"], "exclude_gpu_types": "A100"}, 422),
    ("POST", "/v1/jobs", {**OK, "gpu_types": {"A100": 1}}, 422),
    ("POST", "/v1/jobs", {**OK, "gpus": "0"}, 422),
    ("POST", "/v1/jobs", {**OK, "gpus": "8-2"}, 422),
    ("POST", "/v1/jobs", {**OK, "gpus": [0]}, 422),
    ("POST", "/v1/jobs", {**OK, "gpus": []}, 422),
    ("POST", "/v1/jobs", {**OK, "gpus": 64}, 422),
    ("POST", "/v1/jobs", {**OK, "gpus": {"n": 2}}, 422),
    ("POST", "/v1/jobs", {**OK, "min_gpus": 0}, 422),
    ("POST", "/v1/jobs", {**OK, "max_gpus": 0}, 422),
    ("POST", "/v1/jobs", {**OK, "min_gpus": 4, "max_gpus": 2}, 422),
    ("POST", "/v1/jobs", {**OK, "deadline": -5}, 422),
    ("POST", "/v1/jobs", {**OK, "deadline": 1e12}, 422),
    ("POST", "/v1/jobs", {**OK, "env": {"LD_PRELOAD": "/tmp/x.so"}}, 422),
    ("POST", "/v1/jobs", {**OK, "env": {"PYTHONPATH": "/tmp/x"}}, 422),
    ("POST", "/v1/jobs", {**OK, "env": ["A=1"]}, 422),
    ("POST", "/v1/jobs", {**OK, "env": {"A=B": "1"}}, 422),
    ("POST", "/v1/jobs", {**OK, "args": "--lr 1"}, 422),
    ("POST", "/v1/jobs", {**OK, "args": ["a\u0000b"]}, 422),
    ("POST", "/v1/jobs", {**OK, "script": "-c"}, 422),
    ("POST", "/v1/jobs", {**OK, "script": ""}, 422),
    ("POST", "/v1/jobs", {**OK, "script": "x\ny.py"}, 422),
    ("POST", "/v1/jobs", {**OK, "name": ""}, 422),
    ("POST", "/v1/jobs", {**OK, "name": "a b"}, 422),
    ("POST", "/v1/jobs", {**OK, "name": "a" * 101}, 422),
    ("POST", "/v1/jobs", {**OK, "global_batch_size": 0}, 422),
    ("POST", "/v1/jobs", {**OK, "epochs": 2, "iterations": None}, 422),
    ("POST", "/v1/jobs", {**OK, "elastic": "maybe"}, 422),
    ("POST", "/v1/jobs", {**OK, "elastic": False, "min_gpus": 3}, 422),
    ("POST", "/v1/jobs", {**OK, "resources": "automatic"}, 422),
    ("POST", "/v1/jobs", {**OK, "resources": {"memory": "lots"}}, 422),
    ("POST", "/v1/jobs", {**OK, "resources": {"cpus": 0}}, 422),
    ("POST", "/v1/jobs", {**OK, "colour": "red"}, 422),
    ("POST", "/v1/jobs", [1, 2, 3], 422),
    ("POST", "/v1/jobs", "not json", 422),
    ("POST", "/v1/jobs", {}, 422),
    ("POST", "/v1/jobs", OK, 401, "wrong"),
    ("POST", "/v1/jobs/nojob/scale", {"gpus": 2}, 404),
    ("POST", "/v1/jobs/nojob/cancel", None, 404),
    ("GET", "/v1/jobs/nojob", None, 404),
    ("GET", "/v1/jobs/nojob/logs", None, 404),
    ("GET", "/v1/jobs/nojob/logs?worker=../../admin", None, 404),
    ("GET", "/v1/jobs", None, 401, "wrong"),
    ("GET", "/v1/cluster", None, 401, "wrong"),
    ("GET", "/v1/events?since=x", None, 422, "admin"),
    ("POST", "/v1/users/b%3Bob", None, 422, "admin"),
    ("POST", "/v1/users/admin", None, 409, "admin"),
    ("POST", "/v1/users/mallory", None, 403),
    ("GET", "/v1/events", None, 403),
    ("POST", "/internal/agents/register", {"name": "evil", "num_gpus": 8}, 403),
    ("GET", "/v1/nothing", None, 404),
    ("DELETE", "/v1/jobs", None, 405),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", HTTP, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(HTTP)])
def test_bad_api_requests_get_a_4xx(case, server, user_token):
    from tidal.httpjson import JsonHttp

    method, path, body, status, *who = case
    token = {"admin": server.admin_token, "wrong": "wrong-token"}.get(who[0] if who else "", user_token)
    http = JsonHttp(server.url, token=token, patience_s=5)
    r = http.send(method, path, None if body == "not json" else body)
    assert r.status == status and len(r.body) < 20_000, (r.status, r.text[:300])
    if r.is_json:
        assert "detail" in r.json()


def test_the_corpus_is_large_enough():
    assert len(OFFLINE) + len(ONLINE) + len(HTTP) >= 200


def test_no_bad_input_hangs_the_cli(bad_files, tmp_path):
    """The two that hung (tidal run --workers 0 / -1), as real processes."""
    env = dict(os.environ, **{HOME: str(tmp_path)})
    for workers in ("0", "-1"):
        res = subprocess.run([sys.executable, "-m", "tidal", "run", "--workers", workers, str(bad_files / "ok.py")],
                             env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 2 and "--workers must be at least 1" in res.stdout + res.stderr


# -- Ctrl-C in each long-running command, as a real process in a session of its own ------------
def _interrupt(args: list[str], marker: str, env: dict[str, str], cwd: Path, wait_s: float = 120) -> tuple[int, str]:
    """Start ``tidal ARGS``, wait until its output shows ``marker``, send
    SIGINT to its process group (as a terminal's Ctrl-C does); its exit code
    and whole output."""
    p = subprocess.Popen([sys.executable, "-m", "tidal", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env, cwd=cwd, start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if marker in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if marker:
            assert seen.wait(wait_s), f"{marker!r} never shown:\n{''.join(lines)}"
        else:
            time.sleep(wait_s)
        os.killpg(p.pid, signal.SIGINT)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    reader.join(5)
    return rc, "".join(lines)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, **{HOME: str(tmp_path / "home"), "COLUMNS": "200"}, **extra)


@pytest.mark.timeout(200)
def test_ctrl_c_in_run_stops_the_workers_with_one_line(tmp_path):
    rc, out = _interrupt(["run", "--workers", "2", str(ROOT / "examples" / "mlp.py"), "--epochs", "1000",
                          "--delay", "0.05"], " step ", _env(tmp_path), tmp_path)
    assert rc == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert len([x for x in out.splitlines() if "interrupted (Ctrl-C)" in x]) == 1, out


@pytest.mark.timeout(120)
def test_ctrl_c_in_simulate_leaves_no_output_folder(tmp_path):
    out_dir = tmp_path / "o"
    rc, out = _interrupt(["simulate", "--trace", "cluster10", "--policy", "elasticflow,tidal,edf,tiresias,gandiva,themis",
                          "--out", str(out_dir)], "cluster:", _env(tmp_path), tmp_path)
    if rc == 0:
        pytest.skip("the simulation finished before the interrupt")
    assert rc == 130, out
    assert "Traceback" not in out and f"tidal simulate: interrupted (Ctrl-C); nothing written to {out_dir}" in out
    assert not out_dir.exists()


@pytest.mark.timeout(200)
def test_ctrl_c_stops_up_cleanly(tmp_path):
    """Ctrl-C is how `tidal up` is stopped (docs/control.md): exit 0 after a clean stop, no traceback."""
    rc, out = _interrupt(["up", "--gpus", "2", "--nodes", "1", "--port", str(free_port()), "--home",
                          str(tmp_path / "h")], "dashboard:", _env(tmp_path), tmp_path)
    assert rc == 0 and "Traceback" not in out and out.rstrip().endswith("stopped"), out
    assert "/dashboard/" in out and "admin.token" in out


@pytest.mark.timeout(120)
def test_ctrl_c_in_logs_follow(server, user_token, queued_job, tmp_path):
    env = _env(tmp_path, **{settings.SERVER.name: server.url, settings.TOKEN.name: user_token})
    rc, out = _interrupt(["logs", queued_job, "-f", "--worker", "w0"], "", env, tmp_path, wait_s=4)
    assert rc == 130 and "Traceback" not in out, out
    assert out.strip() == "tidal logs: interrupted (Ctrl-C)", out
