"""Lines and paragraphs of a stream of byte chunks, each bounded by ``max_record_bytes``: a longer one is
:data:`TOO_LONG`, its bytes dropped as they come (never held whole)."""

from __future__ import annotations

MAX_RECORD_BYTES = 512_000_000  # default bound on one line / record: far above any real document


class _TooLong:
    """Stands in for a line or record longer than ``max_record_bytes`` (its bytes were dropped)."""

    def __repr__(self) -> str:
        return "TOO_LONG"


TOO_LONG = _TooLong()


def split_lines(chunks, limit: int):
    """Complete lines (without the trailing newline) of the byte ``chunks``; the last line may lack one. A line
    longer than ``limit`` bytes is yielded as :data:`TOO_LONG`. Lines are split without quadratic copying."""
    pending, plen, dropping = [], 0, False  # the start of the current line; skipping one?
    for data in chunks:
        last = data.rfind(b"\n")
        if last < 0:
            if not dropping:
                pending.append(data)
                plen += len(data)
                if plen > limit:
                    pending, plen, dropping = [], 0, True
            continue
        first = data.find(b"\n")
        if dropping or plen + first > limit:
            yield TOO_LONG
        elif pending:
            pending.append(data[:first])
            yield b"".join(pending)
        else:
            yield data[:first]
        pending, plen, dropping = [], 0, False
        if last > first:
            if last - first <= limit:  # no line in between can be too long
                yield from data[first + 1 : last].split(b"\n")
            else:
                for line in data[first + 1 : last].split(b"\n"):
                    yield line if len(line) <= limit else TOO_LONG
        if last + 1 < len(data):
            tail = data[last + 1 :]
            if len(tail) > limit:
                dropping = True
            else:
                pending, plen = [tail], len(tail)
    if dropping:
        yield TOO_LONG
    elif pending:
        tail = b"".join(pending)
        if tail:
            yield tail


def split_paragraphs(lines, limit: int):
    """``(first line number, paragraph)`` per run of non-blank ``lines`` (from :func:`split_lines`), joined with
    newlines; a paragraph longer than ``limit`` bytes is :data:`TOO_LONG` (its lines are dropped as they come)."""
    buf, size, start, n = [], -1, 0, 0  # size: bytes joined so far (-1: no paragraph)
    for line in lines:
        n += 1
        if line is TOO_LONG or line.strip():
            if size < 0:
                start, size = n, 0
            else:
                size += 1  # the newline joining it to the previous line
            size += limit + 1 if line is TOO_LONG else len(line)
            if size <= limit:
                buf.append(line)
            else:
                buf = []
        elif size >= 0:
            yield start, b"\n".join(buf) if size <= limit else TOO_LONG
            buf, size = [], -1
    if size >= 0:
        yield start, b"\n".join(buf) if size <= limit else TOO_LONG
