"""The Jinja sandbox chat templates run in, bounded in size, steps and time.

A chat template is untrusted code from the Hub (docs/models.md, "Chat"). jinja2's
``ImmutableSandboxedEnvironment`` keeps it away from Python internals and from changing
its inputs, and bounds ``range()``; it does not stop a template from building a string of
``10**10`` characters or from looping ``10**10`` times. Here every render runs under a
budget (``RenderLimits``), on the caller's thread:

- **Size**: no value the template builds, and not its output, may exceed
  ``max_chars + chars_per_input_char * (size of the inputs)`` characters. Every operation
  that can make something much larger than its operands is checked *before* it runs:
  ``*``, ``+``, ``**`` and ``%`` (intercepted binary operators), ``~``, list / tuple /
  dict literals, string methods (``ljust``, ``center``, ``zfill``, ``expandtabs``,
  ``replace``, ``translate``, ``join``, ``format``), the filters that amplify
  (``center``, ``indent``, ``format``, ``join``, ``replace``, ``wordwrap``, ``batch``,
  ``slice``, ``sum``, ``tojson``), ``lipsum``; every other filter's and call's result is
  measured after it (each is at most a small factor of its bounded operands), and items
  drawn from a lazy iterator count toward that iterator's size. Integers are bounded at
  ``MAX_INT_BITS``, nesting at ``MAX_DEPTH``.
- **Steps**: every loop iteration, call and filter is a step; a render may take
  ``max_steps`` of them.
- **Time**: the clock is read at every step; a render past ``timeout_s`` stops there.

A bound that is reached raises ``RenderBoundError`` naming it. The size of a value is its
printed size, estimated without printing it (``_Budget.measure``): a string's length, a
number's digits, and a container's items plus separators, a shared item counted once
per occurrence, so a list doubled 40 times measures 2**40 and is refused.

The checks are hooks of the environment and of its code generator (the compiled
template calls them), so a template that never uses an operation pays nothing for it.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import json
import math
import re
import string
import time
import types
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, generate_lorem_ipsum

__all__ = [
    "CONTAINER_COST",
    "MAX_DEPTH",
    "MAX_INT_BITS",
    "RenderBoundError",
    "RenderLimits",
    "SEPARATOR_COST",
    "compile_template",
    "render_bounded",
    "scalar_cost",
]

MAX_INT_BITS = 1 << 16  # 19,728 digits: Python prints at most 4,300 anyway
MAX_DEPTH = 200  # nesting of a value built by a template (inputs: at most 128)


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """The bounds on one render of a chat template (docs/models.md, "Chat").

    ``max_chars + chars_per_input_char * n`` bounds every value the template builds and
    its output, where ``n`` is the printed size of the messages, tools and template
    arguments; ``max_steps`` bounds loop iterations, calls and filters together;
    ``timeout_s`` bounds the wall time.
    """

    max_chars: int = 1 << 22
    chars_per_input_char: int = 4
    max_steps: int = 1_000_000
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_chars", "chars_per_input_char", "max_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"RenderLimits.{name} must be an int >= 0, got {value!r}.")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < math.inf):
            raise ValueError(
                f"RenderLimits.timeout_s must be a finite number > 0, got {self.timeout_s!r}."
            )


class RenderBoundError(Exception):
    """A render reached one of its bounds (size, steps, time, nesting, integer size).

    Not a ``ValueError``/``TypeError``: jinja's filters catch those (``int``, ``float``),
    and a bound must never be swallowed. The budget also stays tripped, so any later check
    in the same render raises again.
    """


class _NotRendering(Exception):
    """A hook ran outside ``render_bounded`` and ``compile_template`` (where jinja folds
    constant expressions): nothing may run unbounded."""


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "nbengine_chat_template_budget", default=None
)

_Children = Callable[[Any], Iterable[Any]]


def _pairs(mapping: Any) -> Iterable[Any]:
    return itertools.chain.from_iterable(mapping.items())


def _namespace_pairs(ns: Namespace) -> Iterable[Any]:
    attrs: dict[str, Any] = object.__getattribute__(ns, "_Namespace__attrs")
    return _pairs(attrs)


# How to reach the items of each container type a template can hold or build.
_CONTAINERS: dict[type, _Children] = {
    list: iter,
    tuple: iter,
    set: iter,
    frozenset: iter,
    dict: _pairs,
    Namespace: _namespace_pairs,
}
_PLAIN_SCALARS = (float, bool, type(None))
CONTAINER_COST = 8  # an empty container's printed size, rounded up
SEPARATOR_COST = 2  # ", " between items


def _children_of(value: object) -> _Children | None:
    children = _CONTAINERS.get(type(value))
    if children is not None:
        return children
    if isinstance(value, (list, tuple, set, frozenset, KeysView, ValuesView)):
        return iter
    if isinstance(value, dict):
        return _pairs
    if isinstance(value, ItemsView):
        return itertools.chain.from_iterable  # (key, value) pairs
    if isinstance(value, Namespace):
        return _namespace_pairs
    return None


def _items_of(container: object) -> Iterator[Any]:
    children = _children_of(container)
    assert children is not None
    return iter(children(container))


def scalar_cost(value: object) -> int | None:
    """The printed size of a value that holds no others (estimated: the size bound's
    unit); None for a container, whose size is ``CONTAINER_COST`` plus each item's size
    and ``SEPARATOR_COST`` (a dict's keys and values are its items)."""
    kind = type(value)
    if kind is dict or kind is list:
        return None
    if isinstance(value, str):
        return len(value) + 2  # quotes, when printed inside a container
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return 2 + value.bit_length() * 3 // 10  # digits: log10(2) ~ 0.301
    if isinstance(value, float):
        return 24
    if isinstance(value, (bytes, bytearray)):
        return len(value) + 3
    if _children_of(value) is not None:
        return None
    return CONTAINER_COST  # Undefined, macros, loop objects, iterators: short reprs


class _Budget:
    """The bounds of one render and what is left of them."""

    __slots__ = ("cap", "deadline", "error", "limits", "memo", "output", "steps")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.cap = limits.max_chars
        self.output = limits.max_chars
        self.steps = limits.max_steps
        self.deadline = time.monotonic() + limits.timeout_s
        self.error: RenderBoundError | None = None
        # Sizes of the input containers, by id: they are alive for the whole render and the
        # sandbox forbids changing them. Containers the template builds are measured anew.
        self.memo: dict[int, int] = {}

    def admit_inputs(self, inputs: Iterable[object], sizes: Mapping[int, int]) -> None:
        """Measure the inputs once and set the size bound from their size. ``sizes`` holds
        the sizes of containers among them measured already (by id)."""
        self.memo.update(sizes)
        size = 0
        for value in inputs:
            cost = scalar_cost(value)
            if cost is None:
                cost = self.memo.get(id(value)) or self._walk(value, self.memo, math.inf, "")
            size += cost
        self.cap = self.limits.max_chars + self.limits.chars_per_input_char * size
        self.output = self.cap

    # -- refusing ------------------------------------------------------------------------

    def _trip(self, message: str) -> NoReturn:
        if self.error is None:
            self.error = RenderBoundError(f"Rendering the chat template stopped: {message}")
            # Every later check fails too, should anything swallow this one.
            self.steps = self.cap = self.output = -1
        raise RenderBoundError(str(self.error)) from None

    def refuse_size(self, what: str) -> NoReturn:
        if self.error is not None:
            self._trip("")
        limits = self.limits
        self._trip(
            f"{what} would exceed {self.cap:,} characters, the size bound on every value "
            f"and on the output of one render ({limits.max_chars:,} plus "
            f"{limits.chars_per_input_char} per character of the messages, tools and "
            "chat_template_kwargs)."
        )

    def refuse_int(self, what: str) -> NoReturn:
        self._trip(
            f"{what} would build an integer of more than {MAX_INT_BITS:,} bits, the size "
            "bound on integers."
        )

    def check_size(self, size: float, what: str) -> None:
        if size > self.cap:
            self.refuse_size(what)

    def charge(self) -> None:
        """One step: a loop iteration, a call or a filter."""
        self.steps -= 1
        if self.steps < 0 or time.monotonic() > self.deadline:
            if self.error is not None:
                self._trip("")
            if self.steps < 0:
                self._trip(
                    f"it ran more than {self.limits.max_steps:,} steps (loop iterations, "
                    "calls and filters), the step bound on one render."
                )
            self._trip(
                f"it ran longer than {self.limits.timeout_s:g} s, the time bound on one render."
            )

    def emit(self, text: str) -> str:
        """Count ``text`` toward the output bound (every piece the template writes,
        including those gathered by ``{% set %}`` blocks and macros)."""
        self.output -= len(text)
        if self.output < 0:
            self.refuse_size("its output")
        return text

    # -- measuring -----------------------------------------------------------------------

    def measure(self, value: object, what: str) -> int:
        """The printed size of ``value``; refuses one above the size bound."""
        if type(value) is str:
            size = len(value)
        else:
            cost = scalar_cost(value)
            size = cost if cost is not None else self._walk(value, {}, self.cap, what)
        if size > self.cap:
            self.refuse_size(what)
        if type(value) is int and value.bit_length() > MAX_INT_BITS:
            self.refuse_int(what)
        return size

    def _walk(self, root: object, seen: dict[int, int], cap: float, what: str) -> int:
        """The size of the container ``root``, walked without recursion. ``seen`` maps
        the ids of containers already measured (all alive: reachable from ``root``, or
        inputs) to their sizes, so a shared one is walked once and counted at each
        occurrence."""
        what = what or "a value"
        memo = self.memo
        # A frame: [id, iterator over the items, size so far].
        frames: list[list[Any]] = [[id(root), _items_of(root), CONTAINER_COST]]
        on_path = {id(root)}
        while True:
            frame = frames[-1]
            for item in frame[1]:
                cost = scalar_cost(item)
                if cost is None:
                    key = id(item)
                    cost = memo.get(key) or seen.get(key)
                    if cost is None and key in on_path:  # a namespace holding itself
                        cost = CONTAINER_COST  # printed as "..."
                    if cost is None:
                        if len(frames) >= MAX_DEPTH:
                            self._trip(
                                f"{what} is nested more than {MAX_DEPTH} deep, the bound on "
                                "nesting."
                            )
                        on_path.add(key)
                        frames.append([key, _items_of(item), CONTAINER_COST])
                        break
                frame[2] += cost + SEPARATOR_COST
                if frame[2] > cap:
                    self.refuse_size(what)
            else:  # every item measured: the frame's size is final
                frames.pop()
                key, size = frame[0], frame[2]
                on_path.discard(key)
                seen[key] = size
                if not frames:
                    return int(size)
                parent = frames[-1]
                parent[2] += size + SEPARATOR_COST
                if parent[2] > cap:
                    self.refuse_size(what)

    def checked(self, value: Any, what: str) -> Any:
        """``value`` (a call's or a filter's result) if within the bounds; a lazy iterator
        is wrapped so that what it yields counts toward the bounds."""
        kind = type(value)
        if kind is str:
            if len(value) > self.cap:
                self.refuse_size(what)
            return value
        if kind is int:
            self.measure(value, what)  # its number of bits
            return value
        if kind in _PLAIN_SCALARS:
            return value
        if hasattr(kind, "__next__") and hasattr(kind, "__iter__") and kind is not LoopContext:
            return self.meter(value, what)  # an iterator (the Iterator ABC, but cheaper)
        self.measure(value, what)
        return value

    def meter(self, iterator: Iterable[Any], what: str) -> Iterator[Any]:
        """Yield from ``iterator``, a step per item, refusing once the items together
        exceed the size bound (``range(3)|slice(10**9)|list`` yields 10**9 lists)."""
        total = 0
        for item in iterator:
            self.charge()
            total += self.measure(item, what) + SEPARATOR_COST
            if total > self.cap:
                self.refuse_size(what)
            yield item

    def iterate(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """A loop's iterable: a step per iteration."""
        for item in iterable:
            self.charge()
            yield item

    def items(self, iterable: Any, what: str) -> list[Any]:
        """``iterable`` as a list, counted as it is drawn (for ``join`` and ``sum``)."""
        if isinstance(iterable, Iterator):
            return list(self.meter(iterable, what))
        return list(iterable)


def _budget() -> _Budget:
    budget = _CURRENT.get()
    if budget is None:
        raise _NotRendering("a chat template hook ran outside a render")
    return budget


# -- size bounds of operations, computed before they run ---------------------------------


def _widest(budget: _Budget, values: Iterable[Any], what: str) -> int:
    return max((budget.measure(v, what) for v in values), default=0)


def _largest_int(values: Iterable[Any]) -> int:
    return max((abs(v) for v in values if isinstance(v, int)), default=0)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)
_FLOAT_TEXT = 330  # '%f' % 1e308 prints 310 digits


def _number(digits: str) -> float:
    return math.inf if len(digits) > 18 else int(digits)


def _percent_bound(budget: _Budget, fmt: str, args: Any, what: str) -> float:
    """An upper bound on the length of ``fmt % args``."""
    if isinstance(args, Mapping):
        values: list[Any] = list(args.values())
    elif isinstance(args, tuple):
        values = list(args)
    else:
        values = [args]
    widest = _widest(budget, values, what)
    star = _largest_int(values)
    size: float = len(fmt)
    for spec in _PERCENT_SPEC.finditer(fmt):
        if spec.group(3) == "%":
            continue
        for number in spec.group(1, 2):
            if number == "*":
                size += star
            elif number:
                size += _number(number)
        size += widest + _FLOAT_TEXT
    return size


def _format_bound(budget: _Budget, fmt: str, values: list[Any], what: str) -> float:
    """An upper bound on the length of ``fmt.format(...)`` with these argument values."""
    widest = _widest(budget, values, what)
    size: float = 0
    for literal, field, spec, _conversion in string.Formatter().parse(fmt):
        size += len(literal)
        if field is None:
            continue
        size += widest + _FLOAT_TEXT
        if spec:
            if "{" in spec:  # a width given by another argument
                size += _largest_int(values)
            size += sum(_number(d) for d in re.findall(r"\d+", spec))
    return size


def _replace_bound(s: Any, old: Any, new: Any, count: Any = None) -> float:
    text, old, new = str(s), str(old), str(new)
    hits = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old))


def _width(value: Any) -> float:
    return value if isinstance(value, (int, float)) else 0


# String methods that can return far more than their operands: (the string, args,
# kwargs) -> an upper bound on the result's length.
_StrBound = Callable[[Any, tuple[Any, ...], dict[str, Any]], float]


def _padded(s: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    width = args[0] if args else kwargs.get("width", 0)
    return max(len(s), _width(width))


def _expanded(s: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    tabsize = args[0] if args else kwargs.get("tabsize", 8)
    return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(0, _width(tabsize))


def _replaced(s: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    if len(args) < 2 or not isinstance(s, str):
        return len(s) * (1 + sum(len(a) for a in args if isinstance(a, (str, bytes))))
    return _replace_bound(s, *args[:3])


def _translated(s: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    table = args[0] if args else None
    longest = 1
    if isinstance(table, Mapping):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
    return len(s) * max(1, longest)


_STR_METHOD_BOUNDS: dict[str, _StrBound] = {
    "ljust": _padded,
    "rjust": _padded,
    "center": _padded,
    "zfill": _padded,
    "expandtabs": _expanded,
    "replace": _replaced,
    "translate": _translated,
}


# Filters that can return far more than their operands: (budget, value, *params) ->
# (an upper bound on the result's size, the value to pass on: an iterator is drawn into
# a list here, counted, when the bound needs its items).
_FilterBound = Callable[..., tuple[float, Any]]


def _center_bound(budget: _Budget, value: Any, width: Any = 80) -> tuple[float, Any]:
    return max(budget.measure(value, "the filter 'center'"), _width(width)), value


def _indent_bound(
    budget: _Budget, s: Any, width: Any = 4, first: Any = False, blank: Any = False
) -> tuple[float, Any]:
    size = budget.measure(s, "the filter 'indent'")
    pad = len(width) if isinstance(width, str) else _width(width)
    lines = (s.count("\n") if isinstance(s, str) else size) + 1
    return size + lines * pad, s


def _format_filter_bound(
    budget: _Budget, value: Any, *args: Any, **kwargs: Any
) -> tuple[float, Any]:
    what = "the filter 'format'"
    return _percent_bound(budget, str(value), kwargs or args, what), value


def _join_bound(
    budget: _Budget, value: Any, d: Any = "", attribute: Any = None
) -> tuple[float, Any]:
    what = "the filter 'join'"
    items = budget.items(value, what)
    size = sum(budget.measure(v, what) for v in items)
    return size + max(0, len(items) - 1) * len(str(d)), items


def _replace_filter_bound(
    budget: _Budget, s: Any, old: Any, new: Any, count: Any = None
) -> tuple[float, Any]:
    budget.measure(s, "the filter 'replace'")
    return _replace_bound(s, old, new, count), s


def _wordwrap_bound(
    budget: _Budget,
    s: Any,
    width: Any = 79,
    break_long_words: Any = True,
    wrapstring: Any = None,
    break_on_hyphens: Any = True,
) -> tuple[float, Any]:
    size = budget.measure(s, "the filter 'wordwrap'")
    sep = len(str(wrapstring)) if wrapstring is not None else 1
    return size + (size + 1) * sep, s  # at most a line break per character


def _batch_bound(
    budget: _Budget, value: Any, linecount: Any, fill_with: Any = None
) -> tuple[float, Any]:
    if fill_with is None:
        return 0, value
    fill = budget.measure(fill_with, "the filter 'batch'") + SEPARATOR_COST
    return _width(linecount) * fill, value  # the last batch is padded to linecount


def _slice_bound(
    budget: _Budget, value: Any, slices: Any, fill_with: Any = None
) -> tuple[float, Any]:
    return _width(slices) * CONTAINER_COST, value  # one list per slice, even if empty


def _sum_bound(
    budget: _Budget, iterable: Any, attribute: Any = None, start: Any = 0
) -> tuple[float, Any]:
    what = "the filter 'sum'"
    items = budget.items(iterable, what)
    if not any(isinstance(v, (list, tuple, str)) for v in [start, *items]):
        return 0, items
    size = budget.measure(start, what) + sum(budget.measure(v, what) for v in items)
    # Adding lists one by one copies the sum so far each time.
    return max(size, len(items) * size / 64), items


_FILTER_BOUNDS: dict[str, _FilterBound] = {
    "center": _center_bound,
    "indent": _indent_bound,
    "format": _format_filter_bound,
    "join": _join_bound,
    "replace": _replace_filter_bound,
    "wordwrap": _wordwrap_bound,
    "batch": _batch_bound,
    "slice": _slice_bound,
    "sum": _sum_bound,
}


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` as a step: its size bound checked before it runs (for the filters that
    amplify), its result measured after."""
    bound = _FILTER_BOUNDS.get(name)
    offset = 0 if _PassArg.from_obj(func) is None else 1  # context / environment first
    what = f"the filter '{name}'"

    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.charge()
        if bound is not None and len(args) > offset:
            size, value = bound(budget, *args[offset:], **kwargs)
            budget.check_size(size, what)
            args = (*args[:offset], value, *args[offset + 1 :])
        return budget.checked(func(*args, **kwargs), what)

    return bounded


# -- helpers that Hugging Face chat templates use ----------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training
    masks in transformers; rendering just outputs the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """json.dumps as transformers' chat templates call it (jinja's own tojson escapes <,
    >, & and ' for HTML; chat templates want plain JSON). When an indent or separators
    could make it larger than the size bound, it is written piece by piece and stopped
    there."""
    budget = _budget()
    what = "the filter 'tojson'"
    pad = len(indent) if isinstance(indent, str) else _width(indent)
    # json builds each level's indent whole, and a value is at most MAX_DEPTH deep.
    budget.check_size(pad * MAX_DEPTH, what)
    size = budget.measure(value, what)
    seps = sum(len(str(s)) for s in separators) if isinstance(separators, (list, tuple)) else 3
    escaped = 12 if ensure_ascii else 6  # '\ud83d\ude00' for one character, at most
    largest = size * (escaped + seps) + (size // 2 + 1) * (1 + pad * MAX_DEPTH)
    options = {
        "ensure_ascii": ensure_ascii,
        "indent": indent,
        "separators": separators,
        "sort_keys": sort_keys,
    }
    if largest <= budget.cap:  # the usual case (a tool's schema): json.dumps as it is
        return json.dumps(value, **options)  # type: ignore[arg-type]
    pieces: list[str] = []
    total = 0
    for piece in json.JSONEncoder(**options).iterencode(value):  # type: ignore[arg-type]
        total += len(piece)
        if total > budget.cap:
            budget.refuse_size(what)
        pieces.append(piece)
    return "".join(pieces)


def _strftime_now(fmt: str) -> str:
    _budget().check_size(len(str(fmt)) * 16, "strftime_now")  # '%c' writes 24 characters
    return datetime.now().strftime(fmt)


def _lipsum_bound(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> float:
    return _width(n) * _width(max) * 16  # words of at most ~15 characters


# -- the environment and its code generator ----------------------------------------------


class _CodeGenerator(CodeGenerator):
    """jinja's code generator, with the size and step hooks of ``_BoundedEnvironment``
    written into the compiled template: around loop iterables, literals, ``~`` and the
    template's own text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iterables: set[int] = set()  # ids of the For nodes' iterables

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        self._loop_iterables.add(id(node.iter))
        try:
            super().visit_For(node, frame)
        finally:
            self._loop_iterables.discard(id(node.iter))

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iterables:
            return super().visit(node, *args, **kwargs)
        # A loop's iterable (jinja allows no custom node types, so it is recognised here).
        self.write("environment.bounded_iter(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self.write("environment.bounded_value(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self.write("environment.bounded_value(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # an assignment target: ``{% for k, v in ... %}``
            super().visit_Tuple(node, frame)
            return
        self.write("environment.bounded_value(")
        super().visit_Tuple(node, frame)
        self.write(")")

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        # The same join as jinja's own visit_Concat picks, with the size bound around it.
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.bounded_concat({join}, (")
        for operand in node.nodes:
            self.visit(operand, frame)
            self.write(", ")
        self.write("))")

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        # The template's own text counts toward the output bound too (a loop repeats it).
        return f"environment.bounded_text({super()._output_const_repr(group)})"


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every render under the budget set by ``render_bounded``."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
            finalize=self._finalize,
        )
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        for name, func in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, func)

    # -- hooks the compiled template calls -----------------------------------------------

    def _finalize(self, value: Any) -> Any:
        """Every ``{{ expression }}`` the template writes: measured before it is printed,
        then counted toward the output bound (``_Budget.emit``, inlined: it runs often)."""
        budget = _CURRENT.get()
        if budget is None:
            raise _NotRendering("finalize")
        if not isinstance(value, str):  # a str stays as it is (Markup, under autoescape)
            budget.measure(value, "its output")
            value = str(value)
        budget.output -= len(value)
        if budget.output < 0:
            budget.refuse_size("its output")
        return value

    def bounded_text(self, text: str) -> str:
        return _budget().emit(text)

    def bounded_iter(self, iterable: Any) -> Iterator[Any]:
        return _budget().iterate(iterable)

    def bounded_value(self, value: Any) -> Any:
        _budget().measure(value, "a literal")
        return value

    def bounded_concat(
        self, join: Callable[[Iterable[Any]], str], operands: tuple[Any, ...]
    ) -> str:
        """``a ~ b``: measured before the operands are printed and joined."""
        budget = _budget()
        budget.check_size(sum(budget.measure(v, "'~'") for v in operands), "'~'")
        text = join(operands)
        budget.check_size(len(text), "'~'")
        return text

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if operator == "+" and type(left) is str and type(right) is str:  # the common case
            if len(left) + len(right) > budget.cap:
                budget.refuse_size("'+'")
            return left + right
        what = f"'{operator}'"
        budget.check_size(_binop_bound(budget, operator, left, right, what), what)
        if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
            bits = _int_bits(operator, left, right)
            if bits > MAX_INT_BITS:
                budget.refuse_int(what)
        return budget.checked(super().call_binop(context, operator, left, right), what)

    def call(
        __self,  # jinja's own spelling (positional, so that no keyword can clash)
        __context: Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        budget = _budget()
        budget.charge()
        what = "a call"
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)) and isinstance(__obj, types.BuiltinMethodType):
            name = __obj.__name__
            what = f"{type(owner).__name__}.{name}"
            if name == "join" and args:
                items = budget.items(args[0], what)
                size = sum(budget.measure(v, what) for v in items)
                budget.check_size(size + max(0, len(items) - 1) * len(owner), what)
                args = (items, *args[1:])
            elif name in _STR_METHOD_BOUNDS:
                budget.check_size(_STR_METHOD_BOUNDS[name](owner, args, kwargs), what)
        elif isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop
            args = (budget.iterate(args[0]), *args[1:])
        elif __obj is generate_lorem_ipsum:
            what = "lipsum"
            budget.check_size(_lipsum_bound(*args, **kwargs), what)
        return budget.checked(super().call(__context, __obj, *args, **kwargs), what)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` / ``format_map``, as the sandbox wraps them, with a size bound."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt: str = value.__self__
        is_map = value.__name__ == "format_map"

        @functools.wraps(wrapped)
        def bounded(*args: Any, **kwargs: Any) -> str:
            budget = _budget()
            if is_map and args and isinstance(args[0], Mapping):
                values = list(args[0].values())
            else:
                values = [*args, *kwargs.values()]
            what = f"str.{value.__name__}"
            budget.check_size(_format_bound(budget, fmt, values, what), what)
            return wrapped(*args, **kwargs)

        return bounded


def _int_bits(operator: str, left: int, right: int) -> float:
    if operator == "*":
        return left.bit_length() + right.bit_length()
    if right <= 0 or abs(left) <= 1:
        return 1
    return right * math.log2(abs(left))


def _binop_bound(budget: _Budget, operator: str, left: Any, right: Any, what: str) -> float:
    """An upper bound on the size of ``left <operator> right``, before it is computed."""
    if operator == "*":
        if isinstance(right, int) and not isinstance(left, (int, float)):
            sequence, times = left, right
        elif isinstance(left, int) and not isinstance(right, (int, float)):
            sequence, times = right, left
        else:
            return 0
        if isinstance(sequence, (str, bytes)) or _children_of(sequence) is not None:
            return budget.measure(sequence, what) * max(0, times)
        return 0
    if operator == "+":
        sized = (str, bytes, list, tuple)
        if isinstance(left, sized) and isinstance(right, sized):
            return budget.measure(left, what) + budget.measure(right, what)
        return 0
    if operator == "%" and isinstance(left, str):
        return _percent_bound(budget, left, right, what)
    return 0


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the bounded sandbox (raises jinja's errors).

    jinja evaluates constant expressions while compiling (``{{ 'a'|upper }}``); that runs
    under a budget of its own, so it is bounded as a render is. An expression that
    reaches a bound there is left to run time, where it reaches it again."""
    token = _CURRENT.set(_Budget(RenderLimits()))
    try:
        return _environment().from_string(source)
    finally:
        _CURRENT.reset(token)


@functools.lru_cache(maxsize=1)
def _environment() -> _BoundedEnvironment:
    return _BoundedEnvironment()


def render_bounded(
    template: jinja2.Template,
    variables: dict[str, Any],
    limits: RenderLimits,
    sizes: Mapping[int, int] | None = None,
) -> str:
    """Render ``template`` (from ``compile_template``) with ``variables`` on this thread
    under ``limits``; the size bound scales with the size of ``variables``. ``sizes``
    may give the sizes (``scalar_cost``, ``CONTAINER_COST``, ``SEPARATOR_COST``) of
    containers within ``variables`` by id, measured as they were copied. Raises
    ``RenderBoundError`` at a bound, else whatever the template raised."""
    budget = _Budget(limits)
    budget.admit_inputs(variables.values(), sizes or {})
    token = _CURRENT.set(budget)
    try:
        text = template.render(variables)
    finally:
        _CURRENT.reset(token)
    if budget.error is not None:  # reached, and swallowed on the way out
        raise RenderBoundError(str(budget.error))
    return text
