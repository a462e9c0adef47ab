"""What a tenant's job spec may ask of the hosts that run it (docs/security.md).

* ``env``: keys from an allow-list of prefixes (communication and framework
  libraries, the tenant's own ``APP_*``, Tidal's worker tunables) plus what
  the operator adds (``$TIDAL_ENV_ALLOW``). Loader and interpreter variables
  (``LD_PRELOAD``, ``PYTHONPATH``, ...) would run the tenant's code inside
  the job's processes before anything else, and the variables the control
  plane sets itself (master address, worker id, credentials, GPU) would let a
  job act as another: both are refused, for the admin too unless the
  operator allows them. The checkpoint directory (``TIDAL_CHECKPOINT_DIR``,
  whose default is node-local) may be set, to shared storage: an absolute
  path, inside ``$TIDAL_TENANT_ROOT`` when the operator sets one.
* ``script``: a path, never an interpreter option (``-c``, ``-m``).
* ``workdir`` and ``script``: inside the tenant's directory
  (``$TIDAL_TENANT_ROOT/<user>``) when the operator sets a tenant root; the
  admin may use any path.
"""

from __future__ import annotations

import posixpath
import re

from tidal import settings
from tidal.core.errors import InputError

#: prefixes of the variables a job may set
ALLOWED_PREFIXES = (
    "APP_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "CUBLAS_", "CUDNN_", "OMP_", "MKL_", "OPENBLAS_", "KMP_",
    "HF_", "TRANSFORMERS_", "TOKENIZERS_", "WANDB_", "MLFLOW_", "TENSORBOARD_",
)
#: variables a job may set exactly
ALLOWED_KEYS = frozenset({"CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "TZ", "LANG", "LC_ALL"})
#: Tidal settings a job may tune (the others are set by the control plane)
ALLOWED_TIDAL = frozenset(x.name for x in (
    settings.CHECKPOINT_DIR, settings.CHECKPOINT_EVERY, settings.CHECKPOINT_SHARED, settings.COLLECTIVE_TIMEOUT_S,
    settings.OVERLAP, settings.HEARTBEAT_S, settings.DEVICE, settings.LOG_LEVEL,
))
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def _extra_allowed() -> tuple[str, ...]:
    raw = settings.ENV_ALLOW.get() or ""
    return tuple(x.strip() for x in raw.split(",") if x.strip())


def env_key_allowed(key: str) -> bool:
    """Whether a job may set ``key`` (``$TIDAL_ENV_ALLOW`` entries ending in
    ``*`` are prefixes)."""
    for extra in _extra_allowed():
        if (extra.endswith("*") and key.startswith(extra[:-1])) or key == extra:
            return True
    if key.startswith("TIDAL_"):
        return key in ALLOWED_TIDAL
    return key in ALLOWED_KEYS or key.startswith(ALLOWED_PREFIXES)


def check_env(env: dict[str, str]) -> None:
    """Raise :class:`InputError` naming the first key a job may not set."""
    for key in env:
        if not _KEY.match(key):
            raise InputError("not a variable name (letters, digits and _, not starting with a digit)",
                             field=f"env.{key[:40]}")
        if not env_key_allowed(key):
            raise InputError(
                "not allowed: a job may set NCCL_*, GLOO_*, TORCH_*, PYTORCH_*, OMP_*, HF_*, WANDB_*, APP_* (your "
                f"own settings) and the like, and {', '.join(sorted(ALLOWED_TIDAL))}; loader and interpreter "
                "variables (LD_*, PYTHON*, PATH) and what the control plane sets (master, worker id, "
                "credentials, GPUs) are refused; an operator can allow more with $TIDAL_ENV_ALLOW "
                "(docs/security.md)", field=f"env.{key}")
    if settings.CHECKPOINT_DIR.name in env:
        _check_checkpoint_dir(env[settings.CHECKPOINT_DIR.name])


def _check_checkpoint_dir(path: str) -> None:
    """The job's own checkpoint directory: an absolute path without control
    characters, inside the tenant root when the operator sets one (an agent
    running as root creates it for the job's user)."""
    field = f"env.{settings.CHECKPOINT_DIR.name}"
    if not path.startswith("/") or _CONTROL.search(path):
        raise InputError("an absolute path (shared storage for a job on several hosts), without control "
                         "characters", field=field)
    root = settings.TENANT_ROOT.get()
    norm = posixpath.normpath(path)
    if root and not norm.startswith(posixpath.normpath(root).rstrip("/") + "/"):
        raise InputError(f"{norm[:200]} is outside the tenants' directory {root} ($TIDAL_TENANT_ROOT)", field=field)


def check_paths(script: str, workdir: str, user: str, admin: bool) -> None:
    """``script`` is a path, not an option; with a tenant root both paths are
    inside the tenant's directory (the admin's are not checked)."""
    if script.startswith("-"):
        raise InputError(f"{script!r} is an interpreter option: give the path of the training script",
                         field="script")
    root = settings.TENANT_ROOT.get()
    if not root or admin:
        return
    mine = posixpath.normpath(posixpath.join(root, user))
    base = posixpath.normpath(posixpath.join(mine, workdir)) if workdir else mine
    for field, path in (("workdir", base), ("script", posixpath.normpath(posixpath.join(base, script)))):
        if path != mine and not path.startswith(mine + "/"):
            raise InputError(f"{path} is outside your directory {mine} ($TIDAL_TENANT_ROOT/<user>)", field=field)
