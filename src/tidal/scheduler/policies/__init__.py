"""Built-in policies, one module each; importing this package imports every
module in it, and each registers itself with ``@register_policy``."""

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
