"""NVIDIA_REQUIRE_* expressions (REFERENCE §5): parse and check against the host.

Grammar: an expression is space-separated OR clauses; a clause is
comma-separated AND terms; a term is `name op value` without spaces, with
names cuda, driver, arch (compute capability) and brand, and ops
= != < <= > >= (brand: = and != only, compared case-insensitively).
Versions compare numerically component by component, trailing `.0`s ignored
(`12.0` == `12`). Every expression must hold for every selected GPU; cuda and
driver are host-wide, arch and brand per GPU (without a GPU, `none`, they hold).
"""

from __future__ import annotations

from nvctk.base.errors import RequestError, RequirementError, shown
from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

NAMES = ("cuda", "driver", "arch", "brand")
OPS = ("<=", ">=", "!=", "=", "<", ">")  # two-character ops first: "<=" is not "<" + "=..."
# The term grammar is ^([A-Za-z_]+)(<=|>=|!=|==|=|<|>)(.+)$ and a version is
# ^[0-9]+(\.[0-9]+)*$, parsed by hand: `re` costs every CUDA image's start
# milliseconds (nvidia/cuda images all set NVIDIA_REQUIRE_CUDA).
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_TERM_OPS = ("<=", ">=", "!=", "==", "=", "<", ">")  # the pattern's alternation order
_DIGITS = frozenset("0123456789")


class Term(Record):
    __slots__ = ("name", "op", "value")

    def __init__(self, name: str, op: str, value: str) -> None:
        self.name = name
        self.op = op
        self.value = value

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value}"


class Expression(Record):
    __slots__ = ("text", "clauses")  # noqa: RUF023

    def __init__(self, text: str, clauses: tuple[tuple[Term, ...], ...]) -> None:
        self.text = text
        self.clauses = clauses  # OR of ANDs


class HostFacts(Record):
    """The values terms compare against, for one GPU (arch/brand None: no GPU)."""

    __slots__ = ("cuda", "driver", "arch", "brand", "gpu")  # noqa: RUF023

    def __init__(self, cuda: str, driver: str, arch: str | None = None,
                 brand: str | None = None, gpu: str = "") -> None:
        self.cuda = cuda
        self.driver = driver
        self.arch = arch
        self.brand = brand
        self.gpu = gpu  # how to name the GPU in messages


def _split_term(text: str) -> tuple[str, str, str] | None:
    """(name, op, value) as the term pattern matches them, or None."""
    if text.endswith("\n"):
        text = text[:-1]  # `$` also matches before a final newline
    if "\n" in text:
        return None  # `.` never matches one
    i = 0
    while i < len(text) and text[i] in _NAME_CHARS:
        i += 1
    if i == 0:
        return None
    rest = text[i:]
    for op in _TERM_OPS:
        # an op that leaves no value is given up for a shorter one, as the pattern backtracks
        if rest.startswith(op) and len(rest) > len(op):
            return text[:i], op, rest[len(op):]
    return None


def _is_version(value: str) -> bool:
    return all(part and _DIGITS.issuperset(part) for part in value.split("."))


def _component_key(part: str) -> tuple[int, str]:
    """A version component's numeric order without int(): int() refuses more than
    4300 digits, and a container's NVIDIA_REQUIRE_* may hold any number of them."""
    digits = part.lstrip("0")
    return len(digits), digits


def version_key(v: str) -> tuple[tuple[int, str], ...]:
    """Components in numeric order (an ASCII version: _is_version), trailing zeros dropped."""
    parts = [_component_key(p) for p in v.split(".")]
    while len(parts) > 1 and parts[-1] == (0, ""):
        parts.pop()
    return tuple(parts)


def compare_versions(a: str, b: str) -> int:
    ka, kb = version_key(a), version_key(b)
    # pad so (12,) vs (12, 4) compares as 12.0 vs 12.4
    n = max(len(ka), len(kb))
    zero = ((0, ""),)
    ka, kb = ka + zero * (n - len(ka)), kb + zero * (n - len(kb))
    return (ka > kb) - (ka < kb)


def parse_term(text: str, expr: str) -> Term:
    parts = _split_term(text)
    if parts is None:
        raise RequestError(
            f"malformed requirement {shown(text)} in {shown(expr)}: expected name op value, "
            "e.g. cuda>=12.2"
        )
    name, op, value = parts[0].lower(), parts[1], parts[2]
    if op == "==":
        op = "="
    if name not in NAMES:
        raise RequestError(
            f"unknown requirement {shown(name)} in {shown(expr)} (known: {', '.join(NAMES)})"
        )
    if name == "brand":
        if op not in ("=", "!="):
            raise RequestError(f"requirement {shown(text)} in {shown(expr)}: brand takes only "
                               "= or !=")
    elif not _is_version(value):
        raise RequestError(f"requirement {shown(text)} in {shown(expr)}: {shown(value)} is not "
                           "a version")
    return Term(name, op, value)


def parse_expression(expr: str) -> Expression:
    clauses = []
    for clause in expr.split():
        terms = clause.split(",")
        if not all(terms):
            raise RequestError(f"malformed requirement {shown(expr)}: empty term in {shown(clause)}")
        clauses.append(tuple(parse_term(t, expr) for t in terms))
    if not clauses:
        raise RequestError("malformed requirement: empty expression")
    return Expression(expr, tuple(clauses))


def _host_value(term: Term, facts: HostFacts) -> str | None:
    return {"cuda": facts.cuda, "driver": facts.driver, "arch": facts.arch,
            "brand": facts.brand}[term.name]


def term_holds(term: Term, facts: HostFacts) -> bool:
    have = _host_value(term, facts)
    if have is None:
        return True  # arch/brand without a GPU: nothing to check
    if term.name == "brand":
        equal = have.lower() == term.value.lower()
        return equal if term.op == "=" else not equal
    c = compare_versions(have, term.value)
    return {"=": c == 0, "!=": c != 0, "<": c < 0, "<=": c <= 0, ">": c > 0, ">=": c >= 0}[
        term.op
    ]


def _first_failure(clause: Sequence[Term], facts: HostFacts) -> Term | None:
    for t in clause:
        if not term_holds(t, facts):
            return t
    return None


def check(expressions: Sequence[str], hosts: Sequence[HostFacts]) -> None:
    """Raise RequirementError naming the unmet term(s) and the host's values, or
    RequestError for a malformed expression. Parsing happens first, so a typo is
    reported even when no GPU is selected."""
    parsed = [parse_expression(e) for e in expressions]
    for expr in parsed:
        for facts in hosts:
            failures = []
            for clause in expr.clauses:
                bad = _first_failure(clause, facts)
                if bad is None:
                    break
                failures.append(f"{bad} (host {bad.name} {_host_value(bad, facts)})")
            else:
                where = f" on {facts.gpu}" if facts.gpu else ""
                raise RequirementError(
                    f"unmet requirement {shown(expr.text)}{where}: "
                    + "; ".join(f if len(f) <= 200 else f[:197] + "..." for f in failures)
                )
