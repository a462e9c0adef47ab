"""Built-in policies, one module each; :mod:`tidal.scheduler.registry` names them."""
