"""Helpers shared by the dashboard tests."""


def hdr(tok: str) -> dict[str, str]:
    """A bearer-token header."""
    return {"Authorization": f"Bearer {tok}"}
