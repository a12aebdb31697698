"""The key of the request being served, for the code that shapes what a key sees.

router.keys.guard sets it for the request's task (tasks it starts inherit it); nothing else
writes it. Unset (None): a router without keys, a public route, or work not done for a request
(the models' owners, SIGHUP): everything is visible.

Read in these places only: `Pool.get` (a model outside the key's list resolves to nothing, so
every API answers 404 as if it were not there), router.keys.views (listings and model cards),
the request traces (the key's name), and router.responses.routes (whose stored responses and
conversations a request sees; it passes them to the store's thread as a value, since a
ContextVar does not cross `run_in_executor`).
"""

from __future__ import annotations

from contextvars import ContextVar

from router.keys.keyfile import Key

CURRENT: ContextVar[Key | None] = ContextVar("omni_router_key", default=None)


def current_key() -> Key | None:
    return CURRENT.get()


def can_see(names: tuple[str, ...]) -> bool:
    """Whether the current request's key may use the model known by `names` (name, aliases)."""
    key = CURRENT.get()
    return key is None or key.may_use(names)


def sees_internals() -> bool:
    """Whether model cards keep their internals (paths, command lines): admin keys, no keys."""
    key = CURRENT.get()
    return key is None or key.is_admin
