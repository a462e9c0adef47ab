"""What a tenant's job spec may ask of the hosts: the env allow-list (the
PYTHONPATH/sitecustomize token theft and LD_PRELOAD are refused), the
script is a path, and with a tenant root paths stay in the tenant's
directory."""

from __future__ import annotations

import pytest

from tidal.control.jobrules import check_env, check_paths, env_key_allowed
from tidal.core.errors import InputError


@pytest.mark.parametrize("key", ["PYTHONPATH", "PYTHONSTARTUP", "LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "HOME",
                                 "TIDAL_MASTER_URL", "TIDAL_JOB_TOKEN", "TIDAL_WORKER_ID", "TIDAL_HOME",
                                 "TIDAL_ADMIN_TOKEN", "CUDA_VISIBLE_DEVICES", "BASH_ENV", "DATA_DIR"])
def test_loader_interpreter_and_control_plane_variables_are_refused(key):
    assert not env_key_allowed(key)
    with pytest.raises(InputError) as e:
        check_env({key: "x"})
    assert e.value.field == f"env.{key}" and "not allowed" in str(e.value)


def test_communication_framework_and_own_variables_are_allowed(monkeypatch):
    check_env({"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "4", "APP_DATA": "/d",
               "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TIDAL_CHECKPOINT_EVERY": "50", "HF_HOME": "/hf"})
    with pytest.raises(InputError, match="not a variable name"):
        check_env({"A B": "x"})
    monkeypatch.setenv("TIDAL_ENV_ALLOW", "DATA_DIR, MYCO_*")
    check_env({"DATA_DIR": "/d", "MYCO_SEED": "1"})
    assert not env_key_allowed("LD_PRELOAD")


def test_the_script_is_a_path_and_stays_in_the_tenants_directory(monkeypatch):
    with pytest.raises(InputError, match="interpreter option") as e:
        check_paths("-c", "", "alice", admin=False)
    assert e.value.field == "script"
    check_paths("train.py", "/anywhere", "alice", admin=False)  # no tenant root: not checked
    monkeypatch.setenv("TIDAL_TENANT_ROOT", "/srv/tenants")
    check_paths("train.py", "proj", "alice", admin=False)
    check_paths("/srv/tenants/alice/proj/train.py", "", "alice", admin=False)
    for script, workdir, field in [("train.py", "/srv/tenants/bob", "workdir"), ("../bob/x.py", "", "script"),
                                   ("/etc/x.py", "", "script"), ("train.py", "../../..", "workdir")]:
        with pytest.raises(InputError, match="outside your directory") as e:
            check_paths(script, workdir, "alice", admin=False)
        assert e.value.field == field
    check_paths("/opt/x.py", "/opt", "admin", admin=True)
