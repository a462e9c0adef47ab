"""The control plane's REST API as FastAPI routers: ``users``, ``jobs``,
``cluster``, ``health`` and ``internal`` (agents and job masters), assembled by
:func:`tidal.control.server.create_app`. They share the app's state
(``app.state.store``, ``.coordinator``, ``.logs_dir``, and for the agents'
routes ``.heartbeat_clock`` and ``.register_lock``), reached through the
dependencies of :mod:`tidal.control.api.deps`."""
