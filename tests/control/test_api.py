"""REST API behaviour without workers: validation, auth, the GPU invariant,
migrations. The FastAPI app runs in-process on a temporary SQLite store."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from tidal.control.db import Store
from tidal.control.server import create_app
from tidal.control.spec import GpuRequest, load_spec_file, parse_gpu_request
from tidal.core.errors import InputError


@pytest.fixture
def env(store_url, tmp_path):
    store = Store(store_url)
    app = create_app(store, admin_token="admin-tok", home=tmp_path, start_loop=False)
    client = TestClient(app)
    alice = store.add_user("alice", token="alice-tok")
    bob = store.add_user("bob", token="bob-tok")
    client.post("/internal/agents/register", json={"name": "n0", "num_gpus": 4, "virtual": True},
                headers={"Authorization": "Bearer admin-tok"})
    return client, store, {"admin": "admin-tok", "alice": alice, "bob": bob}


def hdr(tok):
    return {"Authorization": f"Bearer {tok}"}


GOOD = {"name": "j", "script": "train.py", "gpus": "1-4", "iterations": 100}


def test_schema_created_by_migrations(env):
    _, store, _ = env
    tables = set(inspect(store.engine).get_table_names())
    assert {"users", "nodes", "gpus", "jobs", "processes", "events", "throughput", "alembic_version"} <= tables
    assert not {"workers", "accuracy"} & tables  # renamed and dropped by migration 0003


def test_bad_field_gets_422_naming_it(env):
    client, _, t = env
    r = client.post("/v1/jobs", json={**GOOD, "gpus": "8-2"}, headers=hdr(t["alice"]))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "gpus"
    r = client.post("/v1/jobs", json={**GOOD, "global_batch_size": 0}, headers=hdr(t["alice"]))
    assert r.status_code == 422 and "global_batch_size" in r.json()["detail"][0]["loc"]
    r = client.post("/v1/jobs", json={**GOOD, "colour": "red"}, headers=hdr(t["alice"]))
    assert r.status_code == 422 and "colour" in r.json()["detail"][0]["loc"]
    r = client.post("/v1/jobs", json={k: v for k, v in GOOD.items() if k != "iterations"}, headers=hdr(t["alice"]))
    assert r.status_code == 422 and "iterations or epochs" in r.text
    r = client.post("/v1/jobs", json={**GOOD, "gpus": 64, "elastic": False}, headers=hdr(t["alice"]))
    assert r.status_code == 422 and "cluster has 4" in r.text
    r = client.post("/v1/jobs", content=b"{not json", headers={**hdr(t["alice"]), "Content-Type": "application/json"})
    assert r.status_code == 422


def test_tokens_and_ownership(env):
    client, _, t = env
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers=hdr("nope")).status_code == 401
    jid = client.post("/v1/jobs", json=GOOD, headers=hdr(t["alice"])).json()["id"]
    assert client.get(f"/v1/jobs/{jid}", headers=hdr(t["alice"])).status_code == 200
    # bob cannot see, scale, cancel or read logs of alice's job
    assert client.get(f"/v1/jobs/{jid}", headers=hdr(t["bob"])).status_code == 404
    assert client.post(f"/v1/jobs/{jid}/scale", json={"gpus": 2}, headers=hdr(t["bob"])).status_code == 404
    assert client.post(f"/v1/jobs/{jid}/cancel", headers=hdr(t["bob"])).status_code == 404
    assert client.get(f"/v1/jobs/{jid}/logs", headers=hdr(t["bob"])).status_code == 404
    assert client.get("/v1/jobs", headers=hdr(t["bob"])).json() == []
    # cluster operations need the admin token
    assert client.post("/internal/agents/register", json={"name": "x", "num_gpus": 1},
                       headers=hdr(t["bob"])).status_code == 403
    assert client.get("/v1/events", headers=hdr(t["alice"])).status_code == 403
    assert client.get(f"/v1/jobs/{jid}", headers=hdr(t["admin"])).status_code == 200
    assert client.post(f"/v1/jobs/{jid}/cancel", headers=hdr(t["alice"])).json()["state"] == "cancelled"


def test_gpu_never_assigned_twice(env):
    _, store, _ = env
    with store.session() as s:
        store.assign_gpus(s, "a", [0, 1])
    with pytest.raises(RuntimeError, match="GPU 1 is not free"):
        with store.session() as s:
            store.assign_gpus(s, "b", [2, 1])
    with store.session() as s:
        # the failed transaction changed nothing: GPU 2 is still free
        assert store.job_gpus(s, "b") == [] and store.job_gpus(s, "a") == [0, 1]
        store.release_gpus(s, "a", [1])
        store.assign_gpus(s, "b", [1])
        assert store.job_gpus(s, "b") == [1]


def test_service_survives_bad_requests(env):
    client, _, t = env
    for body in ([], {"procs": [{"id": "x"}]}, {"procs": "no"}):
        r = client.post("/internal/agents/n0/heartbeat", json=body, headers=hdr(t["admin"]))
        assert r.status_code == 422
    assert client.post("/internal/agents/ghost/heartbeat", json={}, headers=hdr(t["admin"])).status_code == 404
    assert client.post("/internal/agents/register", json={"name": "n0", "num_gpus": 2},
                       headers=hdr(t["admin"])).status_code == 409
    assert client.get("/healthz").json()["status"] == "ok"
    assert "tidal_gpus" in client.get("/metrics").text


def test_yaml_spec_errors_name_file_and_field(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("name: j\nscript: t.py\ngpus: [0, 2]\niterations: 5\n")
    with pytest.raises(InputError) as e:
        load_spec_file(f)
    assert "job.yaml" in str(e.value) and "gpus" in str(e.value)
    f.write_text("name: j\nscript: t.py\ngpus: 2\nepochs: 3\ndataset_size: 640\nglobal_batch_size: 64\n")
    assert load_spec_file(f).total_iterations() == 30
    f.write_text("name: [unclosed\n")
    with pytest.raises(InputError, match="YAML"):
        load_spec_file(f)


def test_gpu_request_forms_parse_in_one_place():
    assert parse_gpu_request(None) == GpuRequest() and parse_gpu_request(None).flexible
    assert parse_gpu_request(4) == parse_gpu_request("4") == GpuRequest(requested=4)
    assert not parse_gpu_request(4).flexible
    assert parse_gpu_request("2-8") == GpuRequest(lo=2, hi=8, requested=8)
    assert parse_gpu_request([4, 1, 2, 2]) == parse_gpu_request("1,2,4") == GpuRequest(allowed=(1, 2, 4), requested=4)
    assert [parse_gpu_request(v).value() for v in (None, "4", " 2 - 8", [4, 1, 2])] == [None, 4, "2-8", [1, 2, 4]]
    for bad, msg in ((0, ">= 1"), ("8-2", "low <= high"), ("lots", "'2-8'"), ([], "non-empty"), ([0, 2], ">= 1"),
                     ("1,x", "'1,2,4'")):
        with pytest.raises(ValueError, match=msg):
            parse_gpu_request(bad)


def test_scale_pins_the_count_the_policy_uses(env):
    client, store, t = env
    jid = client.post("/v1/jobs", json=GOOD, headers=hdr(t["alice"])).json()["id"]
    coord = client.app.state.coordinator
    coord.round()  # admits and starts it on every GPU of the 4-GPU node (EDF: the best count)
    assert len(client.get(f"/v1/jobs/{jid}", headers=hdr(t["alice"])).json()["gpus"]) == 4
    jid2 = client.post("/v1/jobs", json=GOOD, headers=hdr(t["alice"])).json()["id"]
    assert client.post(f"/v1/jobs/{jid2}/scale", json={"gpus": -1}, headers=hdr(t["alice"])).status_code == 422
    assert client.post(f"/v1/jobs/{jid2}/scale", json={"gpus": 3}, headers=hdr(t["alice"])).json()["pinned"] == 3
    # 0 releases the pin; pin again
    assert client.post(f"/v1/jobs/{jid2}/scale", json={"gpus": 0}, headers=hdr(t["alice"])).json()["pinned"] is None
    assert client.get(f"/v1/jobs/{jid2}", headers=hdr(t["alice"])).json()["pinned"] is None
    assert client.post(f"/v1/jobs/{jid2}/scale", json={"gpus": 3}, headers=hdr(t["alice"])).json()["pinned"] == 3
    with store.session() as s:  # the first job is done; its GPUs are free again
        store.release_gpus(s, jid, store.job_gpus(s, jid))
        from tidal.control.db import Job

        s.get(Job, jid).state = "completed"
    coord.round()
    assert len(client.get(f"/v1/jobs/{jid2}", headers=hdr(t["alice"])).json()["gpus"]) == 3


def test_node_down_judgement_survives_a_server_restart(tmp_path):
    """A node is declared down when it stopped heart-beating while others did;
    a restarted server (or one that stalled) must not take its own absence for
    every node's (that would mark all their processes lost)."""
    import time

    from sqlalchemy import update

    from tidal.control.db import Node

    url = f"sqlite:///{tmp_path / 't.db'}"
    store = Store(url)
    client = TestClient(create_app(store, admin_token="adm", home=tmp_path, start_loop=False))
    for n in ("n0", "n1"):
        client.post("/internal/agents/register", json={"name": n, "num_gpus": 2, "virtual": True}, headers=hdr("adm"))

    def beat(node):
        r = client.post(f"/internal/agents/{node}/heartbeat", json={"procs": [], "utils": {}}, headers=hdr("adm"))
        assert r.status_code == 200

    def states():
        return {n["name"]: n["state"] for n in client.get("/v1/cluster", headers=hdr("adm")).json()["nodes"]}

    beat("n0")
    # the server was away for a minute: both nodes' last heartbeats are old
    with store.session() as s:
        s.execute(update(Node).values(last_heartbeat=time.time() - 60))
    client = TestClient(create_app(store, admin_token="adm", home=tmp_path, start_loop=False))  # restarted
    beat("n0")
    beat("n0")
    assert states() == {"n0": "up", "n1": "up"}
    # now n1 really is silent while n0 beats: first it takes no new work (its processes go on),
    # then, past the grace period, it is down
    with store.session() as s:
        s.execute(update(Node).where(Node.name == "n1").values(last_heartbeat=time.time() - 20))
    beat("n0")
    assert states() == {"n0": "up", "n1": "unreachable"}
    beat("n1")  # back within the grace: up again, nothing lost
    assert states() == {"n0": "up", "n1": "up"}
    with store.session() as s:
        s.execute(update(Node).where(Node.name == "n1").values(last_heartbeat=time.time() - 120))
    beat("n0")
    assert states() == {"n0": "up", "n1": "down"}


def test_a_master_silent_with_its_node_is_lost_before_the_grace_ends(tmp_path):
    """An unreachable node's job master that stopped reporting is taken for
    lost at once (it will move to another host of its job); one that keeps
    reporting (only its agent is away) keeps its job."""
    import time

    from sqlalchemy import select, update

    from tidal.control.db import Job, Node, Process

    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    client = TestClient(create_app(store, admin_token="adm", home=tmp_path, start_loop=False))
    for n in ("n0", "n1"):
        client.post("/internal/agents/register", json={"name": n, "num_gpus": 2, "virtual": True}, headers=hdr("adm"))
    now = time.time()
    with store.session() as s:
        for jid, reported in (("quiet", now - 30), ("talking", now)):
            s.add(Job(id=jid, user="alice", name=jid, state="running", submit_time=1.0, spec={},
                      progress={"state": "running", "reported_at": reported}))
            s.add(Process(job_id=jid, name="master", kind="master", node="n1", state="running"))
        s.execute(update(Node).where(Node.name == "n1").values(last_heartbeat=now - 20))
    r = client.post("/internal/agents/n0/heartbeat", json={"procs": [], "utils": {}}, headers=hdr("adm"))
    assert r.status_code == 200
    with store.session() as s:
        masters = {p.job_id: p.state for p in s.scalars(select(Process))}
        assert s.get(Node, "n1").state == "unreachable"
    assert masters == {"quiet": "lost", "talking": "running"}


def test_user_names_are_checked_and_an_existing_user_keeps_its_token(env):
    client, _store, tok = env
    for bad in ("b;ob", "-x", "a" * 65, "ü"):
        r = client.post(f"/v1/users/{bad}", headers=hdr(tok["admin"]))
        assert r.status_code == 422, (bad, r.text)
    r = client.post("/v1/users/carol", headers=hdr(tok["admin"]))
    assert r.status_code == 200
    first = r.json()["token"]
    again = client.post("/v1/users/carol", headers=hdr(tok["admin"]))
    assert again.status_code == 409 and "rotate" in again.json()["detail"]
    assert client.get("/v1/jobs", headers=hdr(first)).status_code == 200  # the first token still works
    rotated = client.post("/v1/users/carol?rotate=true", headers=hdr(tok["admin"])).json()["token"]
    assert client.get("/v1/jobs", headers=hdr(first)).status_code == 401
    assert client.get("/v1/jobs", headers=hdr(rotated)).status_code == 200
    for own in ("admin", "agent"):  # the server's accounts cannot be rotated away through the API
        r = client.post(f"/v1/users/{own}?rotate=true", headers=hdr(tok["admin"]))
        assert r.status_code == 409, r.text
    assert client.get("/v1/jobs", headers=hdr(tok["admin"])).status_code == 200
    assert client.post("/v1/users/dave", headers=hdr(tok["alice"])).status_code == 403


def test_tenant_numbers_that_gave_500s_or_were_accepted_get_422(env):
    """Each body is one that used to reach a 500 (non-finite numbers, an
    overflow, an unmapped InputError) or was silently accepted."""
    client, _, t = env

    def post(raw: str):
        return client.post("/v1/jobs", content=raw, headers={**hdr(t["alice"]), "Content-Type": "application/json"})

    base = '"name": "j", "script": "train.py"'
    bodies = [
        f'{{{base}, "gpus": 2, "epochs": Infinity, "dataset_size": 100}}',
        f'{{{base}, "gpus": 2, "epochs": 1e308, "dataset_size": 10000000000000}}',
        f'{{{base}, "gpus": 2, "iterations": NaN}}',
        f'{{{base}, "gpus": 2, "iterations": 10, "priority": 1e400}}',
        f'{{{base}, "gpus": 2, "iterations": 10, "elastic": false, "min_gpus": 3}}',
        f'{{{base}, "gpus": 1e40, "iterations": 10}}',
        f'{{{base}, "gpus": 2, "iterations": 10, "deadline": Infinity}}',
        f'{{{base}, "gpus": 2, "iterations": 10, "priority": 18446744073709551616}}',
        f'{{{base}, "gpus": [2, 100000000], "iterations": 10}}',
    ]
    for body in bodies:
        r = post(body)
        assert r.status_code == 422, (body, r.status_code, r.text)
        assert len(r.content) < 4000, body  # bounded: the input is not echoed back


def test_a_body_over_1_mb_gets_413_and_is_not_stored(env):
    client, store, t = env
    big = {**GOOD, "args": ["x" * 1000] * 2100}  # about 2 MB
    r = client.post("/v1/jobs", json=big, headers=hdr(t["alice"]))
    assert r.status_code == 413, r.text
    assert client.get("/v1/jobs", headers=hdr(t["alice"])).json() == []
    assert client.post("/v1/jobs", json=GOOD, headers=hdr(t["alice"])).status_code == 201


def test_asking_for_more_gpus_than_the_cluster_or_the_job_allows_is_refused(env):
    client, _, t = env  # the test cluster has 4 GPUs
    r = client.post("/v1/jobs", json={**GOOD, "gpus": 64}, headers=hdr(t["alice"]))
    assert r.status_code == 422 and "cluster has 4" in r.text
    jid = client.post("/v1/jobs", json={**GOOD, "gpus": "1-2"}, headers=hdr(t["alice"])).json()["id"]
    for n in (10**9, 1000, 3):  # a billion; beyond the cluster; beyond the job's own range
        r = client.post(f"/v1/jobs/{jid}/scale", json={"gpus": n}, headers=hdr(t["alice"]))
        assert r.status_code == 422, (n, r.text)
    assert client.post(f"/v1/jobs/{jid}/scale", json={"gpus": 2}, headers=hdr(t["alice"])).status_code == 200
    import time

    t0 = time.monotonic()
    client.app.state.coordinator.round()  # the scheduler is not stalled by any of it
    assert time.monotonic() - t0 < 5.0


def _keyed(client, tok, key, body=GOOD):
    return client.post("/v1/jobs", json=body, headers={**hdr(tok), "Idempotency-Key": key})


def test_a_retried_submission_with_its_idempotency_key_gets_the_same_job(env):
    client, _, t = env
    first = _keyed(client, t["alice"], "retry-1")
    again = _keyed(client, t["alice"], "retry-1")
    assert first.status_code == 201 and again.status_code == 200
    assert again.json() == first.json()  # same job, same shape
    by_query = client.post("/v1/jobs?idempotency_key=retry-1", json=GOOD, headers=hdr(t["alice"]))
    assert by_query.status_code == 200 and by_query.json()["id"] == first.json()["id"]
    assert [j["id"] for j in client.get("/v1/jobs", headers=hdr(t["alice"])).json()] == [first.json()["id"]]
    # the key is the user's own: bob's same key is bob's job
    bobs = _keyed(client, t["bob"], "retry-1")
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]
    # the same key with another body is refused, and creates nothing
    other = _keyed(client, t["alice"], "retry-1", {**GOOD, "iterations": 7})
    assert other.status_code == 422 and "Idempotency-Key" in str(other.json()["detail"])
    assert len(client.get("/v1/jobs", headers=hdr(t["alice"])).json()) == 1
    # a submission without a key is a new job every time
    assert client.post("/v1/jobs", json=GOOD, headers=hdr(t["alice"])).status_code == 201
    assert len(client.get("/v1/jobs", headers=hdr(t["alice"])).json()) == 2


def test_a_malformed_idempotency_key_gets_422_naming_the_header(env):
    client, _, t = env
    for bad in ("", "k" * 129, " lead", "tab\there", "caf\u00e9".encode("latin-1")):
        r = _keyed(client, t["alice"], bad)
        assert r.status_code == 422, (bad, r.text)
        assert any(e["loc"][-1].lower() == "idempotency-key" for e in r.json()["detail"]), r.text
    assert _keyed(client, t["alice"], "k" * 128).status_code == 201
    assert client.get("/v1/jobs", headers=hdr(t["alice"])).json()[0]["name"] == "j"


def test_concurrent_duplicate_submissions_make_one_job(env):
    """Eight clients race with one key: one job, every answer names it."""
    import threading

    client, store, t = env
    answers: list = []
    start = threading.Barrier(8)

    def submit() -> None:
        start.wait()
        answers.append(_keyed(client, t["alice"], "race"))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(r.status_code for r in answers) == [200] * 7 + [201], [r.text for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    assert len(client.get("/v1/jobs", headers=hdr(t["alice"])).json()) == 1


def test_concurrent_submissions_get_distinct_slots(env):
    """Every job gets its own number (its uid slot under --run-as LO-HI),
    also when clients submit at the same moment."""
    import threading

    client, store, t = env
    answers: list = []
    start = threading.Barrier(8)

    def submit(i: int) -> None:
        start.wait()
        answers.append(client.post("/v1/jobs", json=dict(GOOD, name=f"s{i}"), headers=hdr(t["alice"])))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert [r.status_code for r in answers] == [201] * 8, [r.text for r in answers]
    from sqlalchemy import select

    from tidal.control.db import Job

    with store.session() as s:
        slots = sorted(s.scalars(select(Job.slot)).all())
    assert slots == list(range(1, 9)), slots


def test_migration_0006_keeps_existing_jobs(tmp_path):
    """A store at 0005 with a job upgrades: the job stays, without a key."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine, text

    url = f"sqlite:///{tmp_path / 'old.db'}"
    cfg = Config()
    cfg.set_main_option("script_location", "tidal.control:migrations")
    cfg.set_main_option("sqlalchemy.url", url)
    command.upgrade(cfg, "0005")
    eng = create_engine(url)
    with eng.begin() as c:
        c.execute(text("INSERT INTO jobs (id, user, name, state, spec, submit_time, admitted, drop_reason, target, "
                       "master_url, progress, done, attained, executed, waiting_since, tags, rescales, exit_info, "
                       "change) VALUES ('old-1', 'alice', 'old', 'completed', '{}', 1.0, 0, '', 0, '', '{}', 0, 0, "
                       "0, 0, '{}', 0, '', '{}')"))
    eng.dispose()
    store = Store(url)
    indexes = {i["name"]: i for i in inspect(store.engine).get_indexes("jobs")}
    assert indexes["ix_jobs_user_idempotency_key"]["unique"]
    from tidal.control.db import Job

    with store.session(write=False) as s:
        assert s.get(Job, "old-1").idempotency_key is None


def test_logs_are_read_by_process_name_never_by_path(env, tmp_path):
    """alice cannot reach bob's log (or any file) through ``worker``."""
    client, _, t = env
    alice_job = client.post("/v1/jobs", json=GOOD, headers=hdr(t["alice"])).json()["id"]
    bob_job = client.post("/v1/jobs", json=GOOD, headers=hdr(t["bob"])).json()["id"]
    logs = tmp_path / "logs"
    for job, who in ((alice_job, "alice"), (bob_job, "bob")):
        (logs / job).mkdir(parents=True)
        (logs / job / "master.log").write_text(f"{who} secret line\n")
    (tmp_path / "outside.log").write_text("bob secret outside\n")
    attacks = [f"../{bob_job}/master", f"..%2F{bob_job}%2Fmaster", str(logs / bob_job / "master"),
               "/etc/passwd", "../../outside", "../outside", ".", "..", "master/../../outside", "w0\x00"]
    for worker in attacks:
        r = client.get(f"/v1/jobs/{alice_job}/logs", params={"worker": worker}, headers=hdr(t["alice"]))
        assert r.status_code in (404, 422), (worker, r.status_code, r.text)
        assert "bob" not in r.text and "root:" not in r.text, worker
    own = client.get(f"/v1/jobs/{alice_job}/logs", params={"worker": "master"}, headers=hdr(t["alice"]))
    assert own.status_code == 200 and own.text == "alice secret line\n"
    everything = client.get(f"/v1/jobs/{alice_job}/logs", headers=hdr(t["alice"]))
    assert everything.text == "[master] alice secret line\n"


def test_a_cluster_without_gpus_schedules_quietly(tmp_path, caplog):
    """No node (or only a down one) and jobs waiting: rounds decide nothing
    and log no error."""
    import logging

    from sqlalchemy import update

    from tidal.control.db import Node

    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    client = TestClient(create_app(store, admin_token="adm", home=tmp_path, start_loop=False))
    for body in (GOOD, {"name": "s", "script": "t.py", "deadline": 600, "iterations": 10}):
        assert client.post("/v1/jobs", json=body, headers=hdr("adm")).status_code == 201
    coord = client.app.state.coordinator
    with caplog.at_level(logging.WARNING):
        assert coord.round() is None
        client.post("/internal/agents/register", json={"name": "n0", "num_gpus": 2, "virtual": True},
                    headers=hdr("adm"))
        with store.session() as s:
            s.execute(update(Node).values(state="down"))
        assert coord.round() is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert {j["state"] for j in client.get("/v1/jobs", headers=hdr("adm")).json()} == {"submitted"}


def test_the_cli_client_sends_a_fresh_valid_key_that_makes_a_retry_harmless(env):
    """``Api.submit`` keys each submission; resending its request (what the
    transport's retry does after a lost answer) finds the job, not a second one."""
    from tidal.control.client import Api
    from tidal.httpjson import Response

    client, _, t = env
    sent = []

    def send(method, path, body=None, params=None, patience_s=None, headers=None):
        sent.append((method, path, body, dict(headers or {})))
        for _ in range(2):  # the answer to the first try was "lost": the same request again
            r = client.request(method, path, json=body, params=params, headers={**hdr(t["alice"]), **(headers or {})})
        return Response(r.status_code, r.headers["content-type"], r.content)

    api = Api("http://127.0.0.1:9", t["alice"])
    api.http.send = send
    first, second = api.submit(GOOD), api.submit(GOOD)
    keys = [headers["Idempotency-Key"] for *_, headers in sent]
    assert len(set(keys)) == 2 and all(keys)  # one key per submission
    assert first["id"] != second["id"]
    assert len(client.get("/v1/jobs", headers=hdr(t["alice"])).json()) == 2  # not four
