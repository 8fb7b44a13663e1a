"""The Pile's set names, the ``--preset`` set filters, and the ``--include-sets`` / ``--exclude-sets`` filter
the readers apply to each document's ``meta.pile_set_name``."""

from __future__ import annotations

from dataclasses import dataclass

from common.cli import UserError
from data_prep.console import log

# The 22 ``meta.pile_set_name`` values of The Pile (exact spellings, as in the released jsonl).
PILE_SET_NAMES = (
    "Pile-CC",
    "PubMed Central",
    "Books3",
    "OpenWebText2",
    "ArXiv",
    "Github",
    "FreeLaw",
    "StackExchange",
    "USPTO Backgrounds",
    "PubMed Abstracts",
    "Gutenberg (PG-19)",
    "OpenSubtitles",
    "Wikipedia (en)",
    "DM Mathematics",
    "Ubuntu IRC",
    "BookCorpus2",
    "EuroParl",
    "HackerNews",
    "YoutubeSubtitles",
    "PhilPapers",
    "NIH ExPorter",
    "Enron Emails",
)

# --preset NAME: named set filters. pile-uncopyrighted reproduces monology/pile-uncopyrighted, whose
# card says it removed "Books3, BookCorpus2, OpenSubtitles, YTSubtitles, and OWT2" - i.e. also
# OpenWebText2, not only the four sets usually quoted.
PRESETS = {
    "pile-uncopyrighted": {
        "exclude_sets": ["Books3", "BookCorpus2", "OpenSubtitles", "YoutubeSubtitles", "OpenWebText2"],
    },
}
NO_SET = "(none)"  # set name reported for records without meta.pile_set_name


@dataclass
class SetFilter:
    include: frozenset | None = None
    exclude: frozenset = frozenset()

    def keep(self, name: str | None) -> bool:
        if self.include is not None and (name is None or name not in self.include):
            return False
        return name not in self.exclude

    def describe(self) -> dict:
        return {
            "include_sets": sorted(self.include) if self.include is not None else None,
            "exclude_sets": sorted(self.exclude),
        }


def make_set_filter(include=None, exclude=None, preset=None) -> SetFilter:
    excl = set(exclude or [])
    if preset:
        if preset not in PRESETS:
            raise UserError(f"unknown --preset {preset!r}; choose one of {', '.join(PRESETS)}")
        excl |= set(PRESETS[preset].get("exclude_sets", []))
    incl = set(include) if include else None
    if incl is not None and excl & incl:
        raise UserError(f"sets both included and excluded: {', '.join(sorted(excl & incl))}")
    for name in sorted((incl or set()) | excl):
        if name not in PILE_SET_NAMES:
            log(
                f"warning: {name!r} is not one of the Pile's 22 set names "
                f"(exact spellings: {', '.join(PILE_SET_NAMES)})"
            )
    return SetFilter(frozenset(incl) if incl is not None else None, frozenset(excl))
