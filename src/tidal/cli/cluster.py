"""Live-cluster commands: ``tidal server``, ``agent``, ``up``, ``submit``,
``jobs``, ``job``, ``logs``, ``cancel``, ``cluster``, ``user``."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.markup import escape

from tidal.cli.tables import Col, LineConsole, OutputOpt, check_format, emit, fit

from tidal import settings
from tidal.cli.app import app, interruptible

console = Console()
err = LineConsole(stderr=True)  # messages name paths: wrapped between words, a path never cut


def _api(server: Optional[str], token: Optional[str]):
    from tidal.control.client import Api

    return Api(server, token)


def _fail(e: Exception, url: str = "") -> None:
    from tidal.control.client import ApiError

    if isinstance(e, ApiError):
        hint = ""
        if e.status in (401, 403):
            hint = (f" (the admin token is in {settings.home() / 'admin.token'} on the server's machine; "
                    "a user's token comes from `tidal user NAME`; pass it with --token or $TIDAL_TOKEN)")
        err.print("[red]error:[/] " + escape(f"{e}{hint}"))
        raise typer.Exit(2 if e.status in (400, 422) else 1)
    from tidal.httpjson import BadCertificate

    if isinstance(e, BadCertificate):
        err.print("[red]error:[/] " + escape(str(e)))
        raise typer.Exit(1)
    where = f" at {url}" if url else ""
    err.print("[red]error:[/] " + escape(f"cannot reach the server{where}: {e}; start one with `tidal up` "
                                         "(or `tidal server`), or point --server / $TIDAL_SERVER at it"))
    raise typer.Exit(1)


def _request(server_url: Optional[str], token: Optional[str], call):
    """Run ``call(api)``; a server error or no server becomes a clear CLI error."""
    api = None
    try:
        api = _api(server_url, token)
        return call(api)
    except Exception as e:  # noqa: BLE001
        _fail(e, getattr(api, "url", "") or (server_url or ""))


ServerOpt = typer.Option(None, "--server", help="Server URL (default: $TIDAL_SERVER or $TIDAL_HOME/server.json).")
TokenOpt = typer.Option(None, "--token", help="API token (default: $TIDAL_TOKEN or $TIDAL_HOME/token).")


@app.command()
def server(
    host: Optional[str] = typer.Option(
        None, "--host", help="Address to listen on (0.0.0.0: every interface); default $TIDAL_BIND_ADDR, else 127.0.0.1."),
    port: int = typer.Option(8470, "--port", min=1, max=65535, help="The server's port."),
    db: Optional[str] = typer.Option(None, "--db", help="SQLAlchemy URL (default: SQLite in $TIDAL_HOME)."),
    policy: str = typer.Option("edf", "--policy", help="Scheduling policy (same names as `tidal simulate`)."),
    tick: float = typer.Option(2.0, "--tick", help="Scheduling round period in seconds."),
    token: Optional[str] = typer.Option(
        None, "--token", help="Admin token (default: $TIDAL_ADMIN_TOKEN, then $TIDAL_HOME/admin.token, else new). "
                              "Prefer the variable or the file: a command line is visible to every user (ps)."),
    advertise_addr: Optional[str] = typer.Option(
        None, "--advertise-addr", help="Address agents and job masters on other hosts reach the server at "
                                       "(default: --host, or with 0.0.0.0 this host's first non-loopback address)."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM certificate: serve HTTPS (with --tls-key); "
                                                                    "clients verify it against $TIDAL_CA_FILE."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
    engine: Optional[str] = typer.Option(
        None, "--engine", help="Where jobs run: agents (`tidal agent` on each node registers) or ray (this server "
                               "runs one agent per Ray node; needs `pip install 'tidal[ray]'`). Default $TIDAL_ENGINE, "
                               "else agents."),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="With --engine ray: the Ray cluster (host:port); default $TIDAL_RAY_ADDRESS, "
                                    "then $RAY_ADDRESS."),
) -> None:
    """Run the control plane (REST API + scheduler loop)."""
    from tidal.cli.checks import address_problem, db_problem, home_problem, number_problem, port_problem
    from tidal.control.server import serve
    from tidal.net import bind_addr

    bind = bind_addr(host)
    why = (policy_problem(policy) or number_problem("--tick", tick, low=0.0, low_open=True, high=3600.0, unit="s")
           or address_problem(bind, "--host") or port_problem(port, bind) or db_problem(db)
           or (None if db else home_problem(settings.home())))
    if why:
        err.print("[red]error:[/] " + escape(why))
        raise typer.Exit(2)
    for f in (tls_cert, tls_key):
        if f is not None and not f.is_file():
            err.print("[red]error:[/] " + escape(f"{f}: {'a directory, not a PEM file' if f.is_dir() else 'no such file'} "
                                                  "(--tls-cert / --tls-key)"))
            raise typer.Exit(2)
    if (tls_cert is None) != (tls_key is None):
        err.print("[red]error:[/] give --tls-cert and --tls-key together")
        raise typer.Exit(2)
    engine = engine or settings.ENGINE.get()
    on_ready = None
    if engine == "ray":
        on_ready = _ray_engine(ray_address or settings.RAY_ADDRESS.get())
    elif engine != "agents":
        err.print("[red]error:[/] " + escape(f"unknown engine {engine!r}; known: agents, ray"))
        raise typer.Exit(2)
    serve(host=host, port=port, db_url=db, policy=policy, admin_token=token, tick_s=tick, advertise=advertise_addr,
          tls_cert=tls_cert, tls_key=tls_key, on_ready=on_ready)


def _ray_engine(address: Optional[str]) -> Any:
    """Connect to Ray now (a cluster that cannot be reached fails the start);
    the callback ``serve`` calls with its URL and credentials runs the Ray
    nodes' agents in a thread of this server."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        err.print("[red]error:[/] --engine ray needs Ray: pip install 'tidal[ray]'")
        raise typer.Exit(2)
    from tidal.engines.ray import RayEngine, connect

    connect(address)
    return lambda url, credentials: RayEngine(url, credentials.agent_token(), ray_address=address).start()


@app.command("agent-token")
def agent_token(home: Optional[Path] = typer.Option(
        None, "--home", help="The server's state directory (default $TIDAL_HOME); its server.secret (or "
                             "$TIDAL_SECRET_FILE) is read, or created (0600) for a server that has not started "
                             "yet.")) -> None:
    """Print the join token agents register with (the server writes it to
    $TIDAL_HOME/agent.token too). For deployments that must hand it to agents
    before the server first starts, e.g. a Kubernetes Secret.

    Example: tidal agent-token --home /srv/tidal > agent.token
    """
    from tidal.control.credentials import Credentials

    from tidal.control.server import secret_path

    from tidal.cli.checks import home_problem

    if why := home_problem(Path(home or settings.home()), f"--home {home}" if home is not None else ""):
        err.print("[red]error:[/] " + escape(why))
        raise typer.Exit(2)
    path = Path(home) / "server.secret" if home is not None else secret_path(settings.home())
    print(Credentials.from_file(path).agent_token())


def _node_labels(label: list[str], gpu_type: Optional[str], virtual: bool) -> dict[str, str]:
    """``--label KEY=VALUE`` items and the node's GPU type (``--gpu-type``, else
    NVML's name on real GPUs) as the labels the agent registers."""
    from tidal.agent.agent import detect_gpu_type

    labels = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            err.print(f"error: --label {escape(item)!r}: expected KEY=VALUE, e.g. --label switch=rack1")
            raise typer.Exit(2)
        labels[key.strip()] = value.strip()
    if gpu_type is not None and not re.fullmatch(r"[A-Za-z][\w.-]{0,62}", gpu_type):
        err.print(f"error: --gpu-type {escape(gpu_type)!r}: a name like A100 or RTX2080Ti (letters, digits, . _ -)")
        raise typer.Exit(2)
    detected = gpu_type if gpu_type is not None else ("" if virtual else detect_gpu_type())
    if detected:
        labels["gpu-type"] = detected
    return labels


@app.command()
def agent(
    server_url: Optional[str] = ServerOpt,
    token: Optional[str] = TokenOpt,
    name: Optional[str] = typer.Option(None, "--name", help="Node name (default: host name)."),
    virtual_gpus: Optional[int] = typer.Option(None, "--virtual-gpus", min=1, help="Pretend to have N GPUs (no GPU needed)."),
    interval: float = typer.Option(0.5, "--interval", help="Heartbeat period in seconds."),
    advertise_addr: Optional[str] = typer.Option(
        None, "--advertise-addr", help="This node's address for the server and the job masters it starts "
                                       "(default: the interface that routes to the server)."),
    label: list[str] = typer.Option(
        [], "--label", help="KEY=VALUE, repeatable. 'switch=NAME' places the node under that network switch "
                            "in the scheduler's topology (nodes under one switch are packed together)."),
    gpu_type: Optional[str] = typer.Option(
        None, "--gpu-type", help="This node's GPU type (e.g. A100, T4), for virtual GPUs or to override the "
                                 "name NVML reports; jobs can require or exclude types."),
    run_as: Optional[str] = typer.Option(
        None, "--run-as", help="Start job processes unprivileged (the agent must run as root): a uid range "
                               "LO-HI (e.g. 200000-299999) gives each job a uid and group of its own "
                               "(recommended); a user name runs every job as that user. Default "
                               "$TIDAL_RUN_AS. See docs/security.md."),
) -> None:
    """Run the node agent: register GPUs, launch and watch workers.

    Example: TIDAL_TOKEN=$(cat agent.token) tidal agent --server http://10.0.0.1:8470 --run-as 200000-299999
    """
    import logging

    from tidal.agent import Agent, detect_gpus
    from tidal.agent.runas import Unreachable
    from tidal.control.client import find_server, find_token

    logging.getLogger("tidal").setLevel(logging.INFO)
    n = virtual_gpus if virtual_gpus is not None else detect_gpus()
    if n < 1:
        err.print("[red]error:[/] no GPU found; pass --virtual-gpus N to run without GPUs")
        raise typer.Exit(2)
    labels = _node_labels(label, gpu_type, virtual_gpus is not None)
    extra = {}
    run_as = run_as or settings.RUN_AS.get()
    if run_as:
        from tidal.agent.runas import RunAs

        try:
            extra["launcher"] = RunAs(run_as)
        except ValueError as e:
            err.print("[red]error:[/] " + escape(str(e)))
            raise typer.Exit(2)
    try:
        a = Agent(find_server(server_url), find_token(token), name or socket.gethostname(), n,
                  virtual=virtual_gpus is not None, interval_s=interval, address=advertise_addr, labels=labels, **extra)
    except Unreachable as e:  # --run-as: the jobs could not reach their directories
        err.print("[red]error:[/] " + escape(str(e)))
        raise typer.Exit(2)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: a.stop())
    try:
        a.run()
    except KeyboardInterrupt:
        a.stop()
        a.shutdown()


def _port_problem(port: int) -> Optional[str]:
    """Why the server cannot listen on the loopback ``port`` (taken, out of
    range, privileged), or None (so the server that answers there is ours)."""
    from tidal.cli.checks import port_problem

    why = port_problem(port) if port else f"--port {port}: a port is 1-65535"
    return why and why.replace("in use by another process", "in use (another `tidal up` or `tidal server`?)")


def _up_problem(gpus: int, nodes: int, policy: str, home: Path) -> Optional[str]:
    """Why ``tidal up`` cannot start with these options, or None."""
    from tidal.cli.checks import home_problem
    from tidal.control.local import MAX_GPUS_PER_NODE, MAX_NODES

    if nodes < 1:
        return f"--nodes {nodes}: need at least 1"
    if nodes > MAX_NODES:
        return f"--nodes {nodes}: the embedded cluster runs at most {MAX_NODES} (each node is a process here)"
    if gpus < 1:
        return f"--gpus {gpus}: need at least 1"
    if gpus % nodes:
        return f"--gpus {gpus} does not divide into {nodes} nodes (each node gets as many GPUs)"
    if gpus // nodes > MAX_GPUS_PER_NODE:
        return (f"--gpus {gpus}: at most {MAX_GPUS_PER_NODE} per node, so at most {MAX_GPUS_PER_NODE * nodes} "
                f"with {nodes} node(s)")
    if why := policy_problem(policy):
        return why
    return home_problem(home, f"--home {home}")


def _up_layout(gpus: Optional[int], nodes: Optional[int], cluster: Optional[str]
               ) -> tuple[Optional[list[tuple[int, str]]], Optional[str]]:
    """Each node's (GPU count, GPU type) for ``tidal up``, or the reason the
    options cannot give one: ``--cluster`` (``1xT4:4,1xA100:2``, the short
    syntax of ``tidal simulate``) or ``--gpus``/``--nodes`` (alike nodes)."""
    from tidal.control.local import MAX_GPUS_PER_NODE, MAX_NODES
    from tidal.core.errors import InputError
    from tidal.core.topology import parse_cluster

    if cluster is None:
        g, n = 8 if gpus is None else gpus, 2 if nodes is None else nodes
        return ([(g // n, "")] * n if n >= 1 and g >= 1 and g % n == 0 else None), None
    if gpus is not None or nodes is not None:
        return None, "--cluster gives every node's GPUs: leave out --gpus and --nodes"
    try:
        c = parse_cluster(cluster)
    except InputError as e:
        return None, f"--cluster {cluster}: {e.reason}"
    if c.num_nodes > MAX_NODES:
        return None, f"--cluster {cluster}: {c.num_nodes} nodes; the embedded cluster runs at most {MAX_NODES}"
    if max(n.gpus for n in c.nodes) > MAX_GPUS_PER_NODE:
        return None, f"--cluster {cluster}: at most {MAX_GPUS_PER_NODE} GPUs per node"
    return [(n.gpus, n.gpu_type) for n in c.nodes], None


def policy_problem(policy: str, option: str = "--policy") -> Optional[str]:
    """Why ``policy`` names no scheduling policy (with the closest name), or None."""
    from tidal.cli.checks import suggest
    from tidal.scheduler.registry import is_policy, policy_names

    if is_policy(policy):
        return None
    return f"{option} {policy}: unknown policy{suggest(policy, policy_names())} (known: {', '.join(policy_names())})"


def _lock_home(home: Path) -> Any:
    """Hold ``home/up.lock`` while this ``tidal up`` runs (an open file), or
    exit 2 naming the one that holds it: two clusters on one store would
    fight over its jobs."""
    import fcntl

    fh = open(home / "up.lock", "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        err.print("[red]error:[/] " + escape(f"--home {home}: another `tidal up` (pid {holder}) runs on it; "
                                              "stop it, or use another --home"))
        raise typer.Exit(2)
    fh.truncate(0)
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


@app.command()
def up(
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Virtual GPUs in all, split evenly over the nodes "
                                                           "[default: 8]."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Agents (nodes) [default: 2]."),
    cluster: Optional[str] = typer.Option(
        None, "--cluster", help="Nodes of different sizes and GPU types instead of --gpus/--nodes, in "
                                "`tidal simulate`'s syntax: COUNTxTYPE:GPUS,... e.g. 1xT4:4,1xA100:2."),
    policy: str = typer.Option("edf", "--policy", help="Scheduling policy (names as in `tidal simulate`)."),
    port: int = typer.Option(8470, "--port", help="The server's port (1-65535)."),
    home: Optional[Path] = typer.Option(None, "--home", help="State directory (default $TIDAL_HOME)."),
) -> None:
    """Start an embedded cluster (server + local agents with virtual GPUs) and
    keep it running until Ctrl-C (or SIGTERM): the running jobs are then
    suspended with a checkpoint and the next `tidal up` on the same home
    resumes them; a second Ctrl-C stops at once.

    Example: tidal up --gpus 8 --nodes 2;  tidal up --cluster 1xT4:4,1xA100:2
    """
    from tidal.control.local import LocalCluster, layout_conflict

    h = Path(home or settings.home()).absolute()
    layout, problem = _up_layout(gpus, nodes, cluster)
    if layout is None and problem is None:  # --gpus/--nodes that do not make a layout: say why
        problem = _up_problem(8 if gpus is None else gpus, 2 if nodes is None else nodes, policy, h)
    if problem is None and layout is not None:
        problem = (_up_problem(sum(g for g, _ in layout), len(layout), policy, h) if cluster is None
                   else policy_problem(policy) or _home_problem(h))
        problem = problem or _port_problem(port) or layout_conflict(h, [g for g, _ in layout])
    if problem:
        err.print("[red]error:[/] " + escape(problem))
        raise typer.Exit(2)
    lock = _lock_home(h)
    _log_to(h / "server.log")
    os.environ[settings.HOME.name] = str(h)  # the server in this process, and the agents, use this home
    c = LocalCluster(h, layout=layout, policy=policy, port=port, tick_s=1.0, in_process=True)
    import signal

    from tidal.control import interrupts

    # `kill` stops the cluster like Ctrl-C; Ctrl-C even when started from a shell's background, which
    # starts it with SIGINT ignored; either waits for a store transaction of this thread to end
    signal.signal(signal.SIGTERM, interrupts.handler)
    signal.signal(signal.SIGINT, interrupts.handler)
    try:
        _run_until_stopped(c, policy)
    finally:
        lock.close()


def _home_problem(home: Path) -> Optional[str]:
    from tidal.cli.checks import home_problem

    return home_problem(home, f"--home {home}")


def _log_to(path: Path) -> None:
    """This process's log records (the server's among them) go to ``path``,
    as a `tidal server` process's output would; the terminal keeps ``up``'s own lines."""
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)


def _run_until_stopped(c: Any, policy: str) -> None:
    """Start ``c``, wait for Ctrl-C, then stop it (gracefully once, at once on a second Ctrl-C)."""
    try:
        c.start()
        user_token = c.api().add_user("user", rotate=True)  # a restart with the same home re-issues it
        (c.home / "token").write_text(user_token)
        _say(f"Tidal cluster up: {c.url} — {c.describe()}, policy {policy}")
        _say(f"state in {c.home}; user token in {c.home / 'token'}; admin token in {c.home / 'admin.token'}")
        _say(f"dashboard: {c.url}/dashboard/  (open it in a browser on this machine; log in with the admin token "
             f"in {c.home / 'admin.token'} to see every job, or with the user token in {c.home / 'token'})")
        _say_resuming(c)
        _say("submit with: tidal submit job.yaml   (Ctrl-C suspends the running jobs and stops the cluster)")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        if c.embedded.running():  # jobs may run already: the policy resumes suspended ones as agents join
            _stop_gracefully(c)
        else:
            _say("stopping…")
    except (RuntimeError, TimeoutError) as e:
        err.print("[red]error:[/] " + escape(f"the cluster did not start: {e}; see {c.home / 'server.log'} "
                                              "and the agent-N.log files there"))
        raise typer.Exit(1)
    finally:
        _stop_at_last(c)


def _say_resuming(c: Any) -> None:
    """Name the suspended jobs waiting in the store: the policy starts them
    again, and each loads its checkpoint. They are the ones the store held
    when the server started: the policy may have started them by now."""
    ids = c.embedded.resuming
    if ids:
        _say(f"{len(ids)} suspended job(s) resume from their checkpoints: {', '.join(ids)}")


def _stop_gracefully(c: Any) -> None:
    """Suspend the running jobs (:func:`tidal.control.local.drain`) and say
    how each was left; a second Ctrl-C gives up on the ones still running."""
    from tidal.control.local import DRAIN_TIMEOUT_S, drain

    try:
        res = drain(c.embedded, _say)
    except KeyboardInterrupt:
        left = c.embedded.coordinator.draining_left()
        _say("stopping at once" + (f": {len(left)} job(s) not suspended lose their processes and will "
                                   f"fail: {', '.join(left)}" if left else ""))
        return
    if res.suspended:
        _say(f"suspended {len(res.suspended)} job(s) with a checkpoint: {', '.join(res.suspended)}; "
             f"`tidal up --home {c.home}` resumes them")
    for jid, state in sorted(res.ended.items()):
        _say(f"{jid}: {state} meanwhile")
    if res.refused:
        _say(f"not suspended (their master refused): {', '.join(sorted(res.refused))}; "
             "they lose their processes and will fail")
    if res.unsettled:
        _say(f"not suspended within {DRAIN_TIMEOUT_S:.0f} s: {', '.join(res.unsettled)}; stopping at once, "
             "they lose their processes and will fail")


def _say(text: str) -> None:
    """One line of ``tidal up``'s, never wrapped (a log or a pipe reads it whole)."""
    console.print(escape(text), soft_wrap=True)


def _stop_at_last(c: Any) -> None:
    """Stop the agents and the server. A Ctrl-C meanwhile is noted, not
    obeyed: the agents stop their processes first (at most ~20 s)."""
    import signal

    def _busy(*_args: Any) -> None:
        _say("still stopping the agents and the server…")

    signal.signal(signal.SIGINT, _busy)
    signal.signal(signal.SIGTERM, _busy)
    _say("stopping the agents and the server…")
    c.stop()
    _say("stopped")


@app.command()
def submit(
    spec: Optional[Path] = typer.Argument(None, help="YAML job spec (or use the flags)."),
    name: Optional[str] = typer.Option(None, "--name", help="Job name (its id is the name plus a suffix)."),
    script: Optional[str] = typer.Option(None, "--script", help="Training script: a path on the agents' hosts."),
    gpus: Optional[str] = typer.Option(
        None, "--gpus", help="N (rigid: exactly N), LOW-HIGH (elastic range) or a,b,c (allowed sizes). Leave it "
                             "out (here and in the spec) to have the job sized automatically (docs/autoconf.md)."),
    iterations: Optional[int] = typer.Option(None, "--iterations", help="Training steps the job runs (or give "
                                                                         "epochs in a spec)."),
    deadline: Optional[float] = typer.Option(None, "--deadline", help="Seconds after submission."),
    batch: Optional[int] = typer.Option(None, "--batch-size", help="Global batch size (samples per step, all "
                                                                     "workers)."),
    rigid: bool = typer.Option(False, "--rigid", metavar="", help="Never rescale this job: it runs at its "
                                                                  "starting size or waits."),
    arg: list[str] = typer.Option([], "--arg", metavar="TEXT", help="Argument for the script (repeat)."),
    gpu_type: list[str] = typer.Option([], "--gpu-type", metavar="TYPE", help="Run only on GPUs of this type, as "
                                       "the agents report it, e.g. A100 (repeat: any of them)."),
    exclude_gpu_type: list[str] = typer.Option([], "--exclude-gpu-type", metavar="TYPE",
                                               help="Never run on GPUs of this type (repeat)."),
    server_url: Optional[str] = ServerOpt,
    token: Optional[str] = TokenOpt,
) -> None:
    """Submit a job from a YAML spec or flags.

    Example: tidal submit --name bert --script train.py --gpus 2-4 --iterations 1000 --gpu-type A100
    """
    from pydantic import ValidationError

    from tidal.control.spec import JobSubmission, load_spec_file
    from tidal.core.errors import InputError

    try:
        body = load_spec_file(spec).model_dump() if spec else {}
    except InputError as e:
        err.print("[red]error:[/] " + escape(f"{e}"))
        raise typer.Exit(2)
    flags = {"name": name, "script": script, "iterations": iterations, "deadline": deadline,
             "global_batch_size": batch}
    body.update({k: v for k, v in flags.items() if v is not None})
    if arg:
        body["args"] = list(arg)
    if rigid:
        body["elastic"] = False
    if gpus is not None:
        body["gpus"] = gpus  # text; JobSubmission reads it (tidal.control.spec.parse_gpu_request)
    if gpu_type:
        body.pop("gpu_type", None)
        body["gpu_types"] = list(gpu_type)
    if exclude_gpu_type:
        body["exclude_gpu_types"] = list(exclude_gpu_type)
    try:
        sub = JobSubmission(**body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        msg = str(first["msg"]).removeprefix("Value error, ")
        err.print("[red]error:[/] " + escape(f"field '{where}': {msg}" if where else f"{msg} (see `tidal submit --help`)"))
        raise typer.Exit(2)
    # a spec's relative script is resolved against the spec's folder (as a manifest's paths are)
    sub = _checked_script(sub, spec.resolve().parent if spec is not None and script is None else Path.cwd(),
                          server_url)
    ans = _request(server_url, token, lambda api: api.submit(sub.model_dump()))
    console.print(f"submitted {ans['id']}")


def _checked_script(sub: Any, base: Path, server_url: Optional[str]) -> Any:
    """The submission with its script resolved where the user typed it
    (tidal.cli.scriptpath); exit 2 if it is missing and the server is local."""
    from tidal.cli.scriptpath import check_script
    from tidal.control.client import find_server

    try:
        url = find_server(server_url)
    except Exception:  # noqa: BLE001 - a bad server.json: the request reports it
        url = ""
    c = check_script(sub.script, sub.workdir, base, url)
    if c.problem and c.fatal:
        err.print("[red]error:[/] " + escape(f"field 'script': {c.problem}"))
        raise typer.Exit(2)
    if c.problem:
        err.print("[yellow]warning:[/] " + escape(f"script: {c.problem}"))
    return sub.model_copy(update={"script": c.script})


def _fmt_t(t: Optional[float]) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def _step(j: dict) -> str:
    it = j.get("iterations")
    return f"{j['step']}/{it}" if it and j["step"] <= it else str(j["step"])  # a script may ignore iterations


JOB_COLS = (Col("id"), Col("state"), Col("GPUs", justify="right"), Col("step", 1, justify="right"),
            Col("user", 2), Col("JCT s", 2, justify="right"), Col("rescales", 3, justify="right"),
            Col("submitted", 3), Col("types", 3), Col("reason", 1, wrap=True))


def types_text(j: dict) -> str:
    """A job's GPU-type constraint in a few characters: ``A100,V100``, ``!T4``, ``-`` for none."""
    parts = list(j.get("gpu_types") or ()) + ["!" + t for t in j.get("exclude_gpu_types") or ()]
    return ",".join(parts) or "-"


def jobs_table(jobs: list[dict], wide: bool = False) -> Table:
    rows = []
    for j in jobs:
        jct = (j["end_time"] - j["submit_time"]) if j.get("end_time") and j["state"] == "completed" else None
        rows.append([j["id"], j["state"], str(len(j["gpus"])), _step(j), j["user"], f"{jct:.1f}" if jct else "-",
                     str(j["rescales"]), _fmt_t(j["submit_time"]), types_text(j), j.get("reason") or ""])
    return fit("jobs", JOB_COLS, rows, console.width, wide)


@app.command("jobs")
def jobs_cmd(server_url: Optional[str] = ServerOpt, token: Optional[str] = TokenOpt,
             as_json: bool = typer.Option(False, "--json", metavar="", help="Print JSON (same as -o json)."),
             output: str = OutputOpt) -> None:
    """List your jobs (all jobs with the admin token).

    Example: tidal jobs -o wide
    """
    check_format(output)
    jobs = _request(server_url, token, lambda api: api.jobs())
    emit(console, "json" if as_json else output, jobs, lambda wide: jobs_table(jobs, wide))


@app.command("job")
def job_cmd(job_id: str, server_url: Optional[str] = ServerOpt, token: Optional[str] = TokenOpt,
            as_json: bool = typer.Option(False, "--json", metavar="", help="Print JSON (same as -o json)."),
            output: str = OutputOpt) -> None:
    """Show one job: its state, why it ended, and its event history.

    Example: tidal job a-1b2c3d
    """
    check_format(output)
    j = _request(server_url, token, lambda api: api.job(job_id))
    if as_json or output in ("json", "yaml"):
        emit(console, "json" if as_json else output, j, None)
        return
    wide = output == "wide"
    console.print(jobs_table([j], wide))
    if j.get("gpu_types") or j.get("exclude_gpu_types"):
        only, never = ", ".join(j.get("gpu_types") or ()) or "any", ", ".join(j.get("exclude_gpu_types") or ()) or "none"
        console.print(escape(f"GPU types: {only}; never: {never}"))
    if j.get("exit_info"):
        console.print(f"ended: {escape(j['exit_info'])}")
    elif j.get("reason"):
        console.print(f"{j['state']}: {escape(j['reason'])}", overflow="ignore", crop=False)
    rows = []
    for e in j["events"]:
        detail = {k: v for k, v in e.items() if k not in ("time", "kind") and v is not None}
        rows.append([_fmt_t(e["time"]), e["kind"], json.dumps(detail)])
    console.print(fit("events", (Col("time"), Col("event"), Col("detail", 1, wrap=True)), rows, console.width, wide))


ENDED = ("completed", "failed", "cancelled", "dropped")


class _LogTail:
    """Each process's log from its own offset, printed a whole line at a time
    (``[name] line`` when several processes are shown), so following never
    repeats, garbles or loses a line."""

    def __init__(self, api: Any, job_id: str, worker: Optional[str]) -> None:
        self.api, self.job_id, self.worker = api, job_id, worker
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, str] = {}

    def names(self, job: dict) -> list[str]:
        if self.worker:
            return [self.worker]
        return sorted({p["name"] for p in job.get("processes", [])}, key=lambda n: (n != "master", len(n), n))

    def poll(self, job: dict, final: bool) -> None:
        for name in self.names(job):
            text = self.api.logs(self.job_id, offset=self.offsets.get(name, 0), worker=name)
            self.offsets[name] = self.offsets.get(name, 0) + len(text)
            lines = (self.partial.get(name, "") + text).split("\n")
            self.partial[name] = lines.pop()
            if final and self.partial[name]:
                lines.append(self.partial.pop(name))
            prefix = "" if self.worker else f"[{name}] "
            for line in lines:
                sys.stdout.write(f"{prefix}{line}\n")
        sys.stdout.flush()


@app.command()
def logs(job_id: str, follow: bool = typer.Option(False, "--follow", "-f",
                                                   metavar="", help="Keep printing new lines until the job ends."),
         worker: Optional[str] = typer.Option(None, "--worker", help="One process only: master, w0, w1, ..."),
         server_url: Optional[str] = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Print a job's logs, each line prefixed with its process (or one
    process's, as it is); -f follows until the job ends.

    Example: tidal logs a-1b2c3d -f --worker w0
    """
    api = _api(server_url, token)
    tail = _LogTail(api, job_id, worker)
    with interruptible("logs"):
        _follow(api, tail, job_id, worker, follow)


def _follow(api: Any, tail: _LogTail, job_id: str, worker: Optional[str], follow: bool) -> None:
    """Print the logs once, or with ``follow`` until the job ends."""
    try:
        while True:
            job = api.job(job_id)  # read before the logs: once it has ended, this read is the last
            ended = not follow or job["state"] in ENDED
            _check_worker(job, worker, ended)
            tail.poll(job, final=ended)
            if ended:
                break
            time.sleep(1)
    except typer.Exit:
        raise
    except Exception as e:  # noqa: BLE001
        _fail(e)


def _check_worker(job: dict, worker: Optional[str], ended: bool) -> None:
    """Exit 2 naming the job's processes when ``--worker`` names none of them
    (while following a running job it may still start: a scale-out)."""
    known = sorted({p["name"] for p in job.get("processes", [])}, key=lambda n: (n != "master", len(n), n))
    if worker and worker not in known and ended:
        err.print("[red]error:[/] " + escape(f"--worker {worker}: job {job['id']} has no process {worker!r}; "
                                              f"its processes: {', '.join(known) or 'none yet'}"))
        raise typer.Exit(2)


@app.command()
def cancel(job_id: str, server_url: Optional[str] = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Cancel a job (its workers are stopped, its GPUs freed)."""
    ans = _request(server_url, token, lambda api: api.cancel(job_id))
    console.print(f"{ans['id']}: {ans['state']}")


@app.command("cluster")
def cluster_cmd(server_url: Optional[str] = ServerOpt, token: Optional[str] = TokenOpt,
                as_json: bool = typer.Option(False, "--json", metavar="", help="Print JSON (same as -o json)."),
                output: str = OutputOpt) -> None:
    """Show nodes, GPUs and who holds them.

    Example: tidal cluster -o wide
    """
    check_format(output)
    c = _request(server_url, token, lambda api: api.cluster())
    emit(console, "json" if as_json else output, c, lambda wide: cluster_table(c, wide))


def cluster_table(c: dict, wide: bool = False) -> Table:
    rows = [[n["name"], n["state"], f"{g['index']} (#{g['gid']})", g["job"] or "-", n.get("address", ""),
             ",".join(f"{k}={v}" for k, v in (n.get("labels") or {}).items()) or "-"]
            for n in c["nodes"] for g in n["gpus"]]
    cols = (Col("node"), Col("state"), Col("GPU"), Col("job"), Col("address", 1), Col("labels", 2, wrap=True))
    return fit(f"cluster (policy {c['policy']})", cols, rows, console.width, wide)


@app.command()
def user(name: str, rotate: bool = typer.Option(False, "--rotate", metavar="", help="Give an existing user a new token."),
         server_url: Optional[str] = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Create a user (admin token) and print its API token; --rotate replaces
    an existing user's token (the old one stops working).

    Example: tidal user alice > alice.token
    """
    if not name.strip():
        err.print("[red]error:[/] a user name must not be empty")
        raise typer.Exit(2)
    print(_request(server_url, token, lambda api: api.add_user(name, rotate=rotate)))


def cluster_scale(job_id: str, gpus: int, server_url: Optional[str], token: Optional[str]) -> None:
    """``tidal scale ID N`` for a job of the live cluster: pin it at N GPUs
    until ``tidal scale ID 0`` releases it."""
    if gpus < 0:
        err.print(f"[red]error:[/] N {gpus}: give a GPU count, or 0 to release the pin")
        raise typer.Exit(2)
    ans = _request(server_url, token, lambda api: api.scale(job_id, gpus))
    if ans["pinned"] is None:
        console.print(f"{ans['id']}: pin released; the policy sizes it again")
    else:
        console.print(f"{ans['id']}: pinned at {ans['pinned']} GPU(s) until `tidal scale {ans['id']} 0`; the policy "
                      "will not suspend it")
