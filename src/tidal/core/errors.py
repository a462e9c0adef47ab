"""Errors raised on bad input, with enough context for a user to fix it."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: names the source (file), line, field and reason."""

    def __init__(
        self,
        reason: str,
        *,
        source: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.reason = reason
        self.source = source
        self.line = line
        self.field = field
        where = []
        if source is not None:
            where.append(str(source))
        if line is not None:
            where.append(f"line {line}")
        if field is not None:
            where.append(f"field '{field}'")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {reason}" if prefix else reason)
