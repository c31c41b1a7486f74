"""Prune the SGLang wheel to what a setting can execute (placeholder: keeps every member until #3's rules land)."""
from __future__ import annotations

import zipfile


def select_members(zf: zipfile.ZipFile, members: list[zipfile.ZipInfo], cfg: dict
                   ) -> tuple[list[zipfile.ZipInfo], dict]:
    total = sum(m.file_size for m in members)
    return members, {"kept_files": len(members), "kept_bytes": total, "dropped_files": 0, "dropped_bytes": 0}
