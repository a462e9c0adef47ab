"""``python -m tidal.ps --id p0 --ckpt DIR``: one parameter server (see :func:`tidal.ps.server.main`)."""

import sys

from tidal.ps.server import main

sys.exit(main())
