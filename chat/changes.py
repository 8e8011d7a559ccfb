"""What a turn, an edit or an import did to a user's memory (`Remembered`, `Imported`), and a memory as the page
and the API show it (`public`): the results `chat.people.People` returns, which the page, the API and the
conversation render."""

from __future__ import annotations

from dataclasses import dataclass


def public(entry: dict) -> dict:
    """A memory as the API and the page show it: {"id", "text", "created_at", "source", "conversation"}."""
    return {k: entry[k] for k in ("id", "text", "created_at", "source", "conversation") if k in entry}


@dataclass(frozen=True)
class Remembered:
    """A turn's changes to its author's memory: `written` and `forgotten` entries ({"id", "text", ...}), and the
    older memories the new ones `superseded`; an undo's: what it `removed` (what the change wrote) and `restored`
    (what it superseded or forgot). An edit is a memory forgotten and one written with the source "edit"; a
    correction ("Actually it's Pocket, not Rocket.") each memory it corrects forgotten and its corrected text written
    with the source "correction", in the same order."""

    written: tuple[dict, ...] = ()
    superseded: tuple[dict, ...] = ()
    forgotten: tuple[dict, ...] = ()
    note: str = ""  # why nothing changed, when a change was asked for
    removed: tuple[dict, ...] = ()
    restored: tuple[dict, ...] = ()
    corrected: tuple[tuple[str, str], ...] = ()  # a correction's (old text, new text), as `describe` names them

    def __bool__(self) -> bool:
        return bool(self.written or self.forgotten or self.note or self.removed or self.restored)

    def __add__(self, later: "Remembered") -> "Remembered":
        """Two changes of one turn as one (an undo takes back both): a memory the first wrote and the second
        superseded was never there before the turn ("my dog is Rex ..., and remember my dog is Max")."""
        gone, mine = {e["id"] for e in later.superseded}, {e["id"] for e in self.written}
        return Remembered(tuple(e for e in self.written if e["id"] not in gone) + later.written,
                          self.superseded + tuple(e for e in later.superseded if e["id"] not in mine),
                          self.forgotten + later.forgotten, " · ".join(filter(None, [self.note, later.note])),
                          self.removed + later.removed, self.restored + later.restored,
                          self.corrected + later.corrected)

    def describe(self) -> str:
        written, forgotten, parts = list(self.written), list(self.forgotten), []
        if written and forgotten and all(e.get("source") == "edit" for e in written):
            parts.append(f"Edited: {forgotten.pop(0)['text']} -> {written.pop(0)['text']}")
        if self.corrected:  # (a corrected text already remembered wrote nothing: "(already remembered)")
            parts += [f"Corrected: {old} -> {new}" for old, new in self.corrected]
            olds, news = {old for old, _ in self.corrected}, {new for _, new in self.corrected}
            written = [e for e in written if e["text"] not in news]
            forgotten = [e for e in forgotten if e["text"] not in olds]
        parts += [f"Remembered: {e['text']}" for e in written]
        parts += [f"(replaces: {e['text']})" for e in self.superseded]
        parts += [f"Forgot: {e['text']}" for e in forgotten]
        parts += [f"Removed: {e['text']}" for e in self.removed]
        parts += [f"Restored: {e['text']}" for e in self.restored]
        return " · ".join(parts + ([self.note] if self.note else []))


@dataclass(frozen=True)
class Imported:
    """What an import did: `kept` of its memories (new, and not replaced by a later one of the same file) of `items`
    in the file; `duplicates` of memories kept already, `replaced` earlier memories they superseded, `shadowed` items
    a later item of the file superseded."""

    kept: int
    items: int = 0
    duplicates: int = 0
    replaced: int = 0
    shadowed: int = 0

    def describe(self) -> str:
        """The status line: what was kept, and why the rest was not."""
        rest = [f"{n} {what}" for n, what in ((self.duplicates, "already remembered"),
                                              (self.replaced, "earlier memories replaced"),
                                              (self.shadowed, "replaced by a later item of the file")) if n]
        return f"imported {self.kept} new memories" + (f" of {self.items} ({', '.join(rest)})" if rest else "")
