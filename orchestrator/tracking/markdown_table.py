"""The Markdown tables of the runs' pages (job, sweep, budget), written so that MLflow shows them readably.

MLflow 3's description renders a table with no cell padding, and breaks a cell wherever the browser may:
`ddtree_tb16` ran into `4.00` (`ddtree_tb164.00`), `FINISHED` into `tiny_trained`, and intervals wrapped
at their dash (`2.47–` over `4.74`). So every cell gets a no-break space at each end (Markdown trims only
ASCII spaces), and a short body cell, a figure or a name, is kept on one line (its spaces no-break ones, its
dashes joined). Headers and long cells (an error line) still wrap. The padding is written `&nbsp;`: a
Markdown table trims each cell of whitespace, a no-break space included, before entities are read.
"""

from __future__ import annotations

from collections.abc import Sequence

NBSP, JOINER = "\u00a0", "\u2060"
PAD = "&nbsp;"
WHOLE_UP_TO = 24  # body cells up to this long never wrap


def unbreakable(text: str) -> str:
    """`text` kept on one line wherever it stands: its spaces no-break ones, its dashes joined. For a part of a
    long cell that must not wrap inside (a figure with its interval: `τ 7.25 (6.85–7.65)`)."""
    return text.replace(" ", NBSP).replace("–", f"{JOINER}–{JOINER}").replace("-", f"{JOINER}-{JOINER}")


def _keep_whole(text: str) -> str:
    return text if len(text) > WHOLE_UP_TO else unbreakable(text)


def _cell(text: str, body: bool) -> str:
    text = text.replace("|", "\\|")
    if body:
        text = _keep_whole(text)
    return f"{PAD}{text}{PAD}" if text else ""


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The table's lines: the header, its rule, one line per row."""
    lines = ["| " + " | ".join(_cell(h, body=False) for h in header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(c, body=True) for c in row) + " |" for row in rows]
    return lines


def plain_markdown(text: str) -> str:
    """A page's Markdown with the tables' padding and joins taken out (`|  job  |` → `| job |`)."""
    text = text.replace(JOINER, "").replace(f" {PAD}", " ").replace(f"{PAD} ", " ")
    return text.replace(NBSP, " ")
