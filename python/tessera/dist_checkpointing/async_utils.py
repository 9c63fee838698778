"""Where tessera first kept its async save names; they live in ``strategies.async_utils``
(megatron-core's module) and are the same objects here."""

from .strategies.async_utils import *  # noqa: F401,F403
