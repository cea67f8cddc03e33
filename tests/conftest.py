from __future__ import annotations

import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
