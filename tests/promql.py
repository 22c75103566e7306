"""The metric names a PromQL expression reads, and the queries of a Grafana dashboard.

Standard library only. Imported by ``tests/unit/test_dashboard.py`` and by molecule verifiers as
``tests.promql`` (the repository root on ``sys.path``; ``tests/`` is a namespace package).

``metric_names`` tokenizes the expression and drops everything that is not a metric name: string
literals, label matchers ``{...}``, ranges and subqueries ``[...]``, grouping label lists (``by``,
``without``, ``on``, ``ignoring``, ``group_left``, ``group_right``), function names (an identifier
followed by ``(``), keywords and aggregation operators, numbers and durations, comments, and
Grafana variables (``$__rate_interval``, ``${var}``). It does not check the expression's grammar
beyond balanced brackets and closed strings.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["dashboard_queries", "metric_names"]

# Identifiers that are never metric names, compared lower-case (PromQL reads keywords case-insensitively).
# Aggregation operators, binary keywords, modifiers and the float literals Inf and NaN.
KEYWORDS = frozenset({
    "sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "limitk", "limit_ratio",
    "and", "or", "unless", "atan2", "bool", "offset", "start", "end",
    "by", "without", "on", "ignoring", "group_left", "group_right",
    "inf", "nan",
})
# Keywords whose parenthesised list holds label names, not expressions.
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<variable>\$\{[^}]*\}|\$\w+)
  | (?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)[a-zA-Z0-9]*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^=<>,@(){}\[\]])
""", re.VERBOSE)

_PAIRS = {"(": ")", "[": "]", "{": "}"}
_CLOSERS = frozenset(_PAIRS.values())

Token = tuple[str, str]  # (kind, text): kind is one of the group names of _TOKEN


def _tokens(expr: str) -> list[Token]:
    """The tokens of ``expr`` without spaces, comments and Grafana variables; ValueError at an unreadable character
    (an unterminated string, or a character PromQL does not use)."""
    out: list[Token] = []
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read the PromQL at offset {pos}: {expr[pos:pos + 20]!r} in {expr!r}")
        kind = match.lastgroup or ""
        if kind not in ("space", "comment", "variable"):
            out.append((kind, match.group()))
        pos = match.end()
    return out


def _closing(tokens: Sequence[Token], start: int) -> int:
    """Index of the bracket that closes the one at ``tokens[start]``; ValueError when it is never closed."""
    opener = tokens[start][1]
    closer = _PAIRS[opener]
    depth = 0
    for index in range(start, len(tokens)):
        kind, text = tokens[index]
        if kind != "op":
            continue
        if text == opener:
            depth += 1
        elif text == closer:
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"unclosed {opener!r} in the PromQL")


def _unquote(literal: str) -> str:
    """The value of a PromQL string literal (Go escapes read as Python's; a backtick string is raw)."""
    if literal.startswith("`"):
        return literal[1:-1]
    try:
        value = ast.literal_eval(literal)
    except (SyntaxError, ValueError):
        return literal[1:-1]
    return value if isinstance(value, str) else literal[1:-1]


def _names_in_matchers(tokens: Sequence[Token]) -> set[str]:
    """Metric names given inside a ``{...}`` selector: ``__name__="x"`` and a bare quoted name (PromQL 3's
    ``{"my.metric"}``). A regular-expression or negative ``__name__`` matcher names no single metric."""
    names: set[str] = set()
    groups: list[list[Token]] = [[]]
    for token in tokens:
        if token == ("op", ","):
            groups.append([])
        else:
            groups[-1].append(token)
    for group in groups:
        if len(group) == 1 and group[0][0] == "string":
            names.add(_unquote(group[0][1]))
        elif len(group) == 3 and group[1] == ("op", "=") and group[2][0] == "string":
            label = _unquote(group[0][1]) if group[0][0] == "string" else group[0][1]
            if label == "__name__":
                names.add(_unquote(group[2][1]))
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads.

    Input: a PromQL expression, as Prometheus rules or a Grafana target's ``expr`` hold it (Grafana
    variables such as ``$__rate_interval`` allowed). Output: the set of metric names it selects, by bare
    name (``vllm:num_requests_waiting``, recording-rule names with colons included) or by an equality
    ``__name__`` matcher; empty for an expression of constants only (``vector(1)``).

    Raises ValueError on an unterminated string, an unbalanced bracket or a character PromQL does not use,
    and TypeError when ``expr`` is not a string.
    """
    if not isinstance(expr, str):
        raise TypeError(f"expected a PromQL string, got {type(expr).__name__}")
    tokens = _tokens(expr)
    names: set[str] = set()
    depth = 0  # open parentheses of the expression itself
    index = 0
    while index < len(tokens):
        kind, text = tokens[index]
        following = tokens[index + 1] if index + 1 < len(tokens) else ("", "")
        if kind == "op" and text in ("{", "["):
            end = _closing(tokens, index)
            if text == "{":
                names |= _names_in_matchers(tokens[index + 1:end])
            index = end + 1
            continue
        if kind == "op" and text in _CLOSERS:
            depth -= 1
            if text != ")" or depth < 0:
                raise ValueError(f"unbalanced {text!r} in the PromQL {expr!r}")
        elif kind == "op" and text == "(":
            depth += 1
        elif kind == "ident":
            lowered = text.lower()
            if lowered in GROUPING and following == ("op", "("):
                index = _closing(tokens, index + 1) + 1
                continue
            if following != ("op", "(") and lowered not in KEYWORDS:
                names.add(text)
        index += 1
    if depth != 0:
        raise ValueError(f"unclosed '(' in the PromQL {expr!r}")
    return names


def _panels(panels: Any) -> Iterator[Mapping[str, Any]]:
    """Every panel of a panel list, depth first: a collapsed row keeps its panels in its own ``panels``."""
    for panel in panels or []:
        if not isinstance(panel, Mapping):
            raise TypeError(f"expected a panel object, got {type(panel).__name__}")
        yield panel
        yield from _panels(panel.get("panels"))


def dashboard_queries(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel of a Grafana dashboard model, in file order.

    Input: the dashboard JSON as a mapping (``json.load`` of a dashboard file or of ``GET
    /api/dashboards/uid/<uid>``'s ``dashboard``). Panels nested in rows are included: those of a
    collapsed row (``panels`` inside the row) and those of pre-schema-16 ``rows``. A target without an
    ``expr`` gives ``""``; a panel without targets (a row, a text panel) gives nothing.

    Raises TypeError when ``dashboard`` or one of its panels is not a mapping.
    """
    if not isinstance(dashboard, Mapping):
        raise TypeError(f"expected the dashboard object, got {type(dashboard).__name__}")
    top: list[Any] = list(dashboard.get("panels") or [])
    for row in dashboard.get("rows") or []:
        if not isinstance(row, Mapping):
            raise TypeError(f"expected a row object, got {type(row).__name__}")
        top.extend(row.get("panels") or [])
    queries: list[tuple[str, str]] = []
    for panel in _panels(top):
        for target in panel.get("targets") or []:
            expr = target.get("expr", "") if isinstance(target, Mapping) else ""
            queries.append((str(panel.get("title", "")), str(expr)))
    return queries
