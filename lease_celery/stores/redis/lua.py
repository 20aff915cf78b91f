"""The Redis store's Lua scripts: one file a script in ``scripts/``, each run behind
``prelude.lua`` (the server's clock and the helpers the scripts share)."""

from __future__ import annotations

from importlib import resources

__all__ = ["HISTORY_PER_KEY", "HISTORY_RECENT", "PRELUDE", "SCRIPTS"]

#: Events kept per key, and across keys (``recent_history``), on Redis.
HISTORY_PER_KEY = 100
HISTORY_RECENT = 1000


def _load() -> tuple[str, dict[str, str]]:
    folder = resources.files(__package__).joinpath("scripts")
    texts = {entry.name.removesuffix(".lua"): entry.read_text("utf-8")
             for entry in folder.iterdir() if entry.name.endswith(".lua")}
    prelude = (texts.pop("prelude").replace("__HISTORY_PER_KEY__", str(HISTORY_PER_KEY))
               .replace("__HISTORY_RECENT__", str(HISTORY_RECENT)))
    return prelude, texts


#: The prelude, history caps filled in; and each script's own text, by name.
PRELUDE, SCRIPTS = _load()
