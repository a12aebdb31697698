"""The worker's command-line defaults that the router relies on (one place for both sides)."""

from __future__ import annotations

DEFAULT_PARALLEL = 4  # omni-worker's --parallel: slots, i.e. requests decoded at once
DEFAULT_CTX = 4096  # omni-worker's --ctx-size: the context, all slots together
