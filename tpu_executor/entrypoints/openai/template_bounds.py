"""The size bounds of a chat-template render (``templates.py``): every operation that can turn
short input into long text in one step is estimated before it runs and refused past the limit.
These are ``*``, ``**``, ``+`` and ``%``, the ``~`` concatenation, each ``{{ ... }}`` output, the
string methods and filters that pad, repeat, replace, join or format, and the ``str()`` of
containers they imply (a list holding one long string many times writes it many times).
"""
from __future__ import annotations

import functools
import re
import string
from typing import Any, Callable, Dict

from jinja2.utils import Namespace

# A product or power of integers past this many bits is refused (Python prints no integer of
# more than 4,300 digits anyway); it bounds the CPU one operator can take.
MAX_INT_BITS = 1 << 16


class ChatTemplateError(Exception):
    """A template at fault whatever the conversation: one that does not compile, or runs past a limit."""


class TemplateLimitError(ChatTemplateError):
    """A render that ran past the time limit or built text past the size limit."""


def text_size(value: Any, limit: int) -> int:
    """About how many characters ``str(value)`` has (containers by their ``repr``), counted up
    to just past ``limit``: a container holding the same long string many times counts it each
    time, as ``str`` writes it each time."""
    total, pending = 0, [value]
    while pending and total <= limit:
        item = pending.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) + 2  # the quotes a repr adds
        elif isinstance(item, (list, tuple, set, frozenset, dict)):
            total += 2 + 2 * len(item)  # brackets and separators
            if total <= limit:
                pending.extend(item.items() if isinstance(item, dict) else item)
        elif isinstance(item, Namespace):
            pending.append(object.__getattribute__(item, "_Namespace__attrs"))
        else:
            total += 24  # a number, None, a bool or an object with a short repr
    return total


class Bounds:
    """The size checks, given the largest text a render may build."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars

    def check(self, size: int, what: str) -> None:
        """``TemplateLimitError`` naming ``what`` when ``size`` characters pass the limit."""
        if size > self.max_chars:
            raise TemplateLimitError(f"the chat template builds {what} longer than this server's limit of "
                                     f"{self.max_chars} characters")

    def size(self, value: Any) -> int:
        """``text_size`` of ``value``, counted to just past the limit."""
        return text_size(value, self.max_chars)

    def binop(self, operator: str, left: Any, right: Any) -> None:
        """``left <operator> right`` checked before it runs."""
        if operator == "*":
            self._product(left, right)
        elif operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if right * left.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template computes a power past {MAX_INT_BITS} bits")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            self.check(len(left) + len(right), "a sum")
        elif operator == "%" and isinstance(left, str):
            self.check(len(left) + percent_width(left, right) + self.size(right), "a formatted string")

    def _product(self, left: Any, right: Any) -> None:
        if _is_int(left) and _is_int(right):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template computes a product past {MAX_INT_BITS} bits")
            return
        sequence, times = (left, right) if _is_int(right) else (right, left)
        if isinstance(sequence, (str, list, tuple)) and _is_int(times):
            self.check(len(sequence) * max(times, 0), "a repeated string or list")

    def method(self, method: Any, args: tuple, kwargs: dict) -> tuple:
        """A call of a string's method checked before it runs; its arguments (a ``join`` of
        an iterator reads it once, into a list)."""
        method = getattr(method, "__wrapped__", method)  # Jinja wraps str.format for its sandbox
        text = getattr(method, "__self__", None)
        if not isinstance(text, str):
            return args
        name = getattr(method, "__name__", "")
        if name == "join" and args and not isinstance(args[0], (list, tuple)):
            args = (list(args[0]),) + args[1:]
        estimate = _METHOD_SIZES.get(name)
        if estimate is not None:
            self.check(estimate(self, text, args, kwargs), f"a string (with str.{name})")
        return args


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first(args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    return args[0] if args else kwargs.get(name, default)


def _int_or(value: Any, default: int) -> int:
    return value if _is_int(value) else default


def _replaced_size(text: str, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    times = len(text) + 1 if old == "" else text.count(old)
    if _is_int(count) and count >= 0:
        times = min(times, count)
    return len(text) + times * max(len(new) - len(old), 0)


_PERCENT_FIELD = re.compile(r"%[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")


def percent_width(fmt: str, args: Any) -> int:
    """The widest padding a ``%`` format asks for (``*`` takes the width from the arguments)."""
    widths = [0]
    for field in _PERCENT_FIELD.finditer(fmt):
        for width in field.groups():
            if width == "*":
                values = args if isinstance(args, tuple) else (args,)
                widths.extend(abs(v) for v in values if _is_int(v))
            elif width:
                widths.append(int(width))
    return max(widths) * max(fmt.count("%"), 1)


def format_width(fmt: str, args: tuple, kwargs: dict) -> int:
    """The widest padding a ``str.format`` format asks for (a nested ``{}`` in a field's spec
    takes it from the arguments)."""
    widths = [0]
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec:
            widths.extend(int(digits) for digits in re.findall(r"\d+", spec))
            if "{" in spec:
                widths.extend(abs(v) for v in (*args, *kwargs.values()) if _is_int(v))
    return max(widths) * max(fmt.count("{"), 1)


# Per string method: the length of its result, estimated from its string and arguments.
_METHOD_SIZES: Dict[str, Callable[[Bounds, str, tuple, dict], int]] = {
    **{name: (lambda b, s, a, k: max(len(s), _int_or(_first(a, k, "width", 0), 0)))
       for name in ("center", "ljust", "rjust", "zfill")},
    "expandtabs": lambda b, s, a, k: len(s) + s.count("\t") * _int_or(_first(a, k, "tabsize", 8), 8),
    "replace": lambda b, s, a, k: _replaced_size(s, *(list(a) + [None, None, -1])[:3]),
    "join": lambda b, s, a, k: b.size(a[0] if a else ()) + len(s) * len(a[0] if a else ()),
    "format": lambda b, s, a, k: len(s) + b.size(a) + b.size(k) + format_width(s, a, k),
    "format_map": lambda b, s, a, k: len(s) + b.size(a) + format_width(
        s, (), a[0] if a and isinstance(a[0], dict) else {}),
    "translate": lambda b, s, a, k: len(s) * max(
        [len(v) for v in (a[0].values() if a and isinstance(a[0], dict) else ()) if isinstance(v, str)] + [1]),
}


def _width(value: Any) -> int:
    """An indentation or separator given as a count or as the text itself."""
    return len(value) if isinstance(value, str) else _int_or(value, 0)


def _indented_size(bounds: Bounds, value: Any, width: Any) -> int:
    lines = value.count("\n") + 1 if isinstance(value, str) else bounds.size(value)
    return bounds.size(value) + lines * _width(width)


def _replace_filter_size(bounds: Bounds, value: Any, args: tuple, kwargs: dict) -> int:
    old, new, count = (list(args) + [kwargs.get("old"), kwargs.get("new"), kwargs.get("count")])[:3]
    if isinstance(value, str):
        return _replaced_size(value, old, new, count)
    return bounds.size(value) * max(len(new) if isinstance(new, str) else 1, 1)


def _json_size(bounds: Bounds, value: Any, args: tuple, kwargs: dict) -> int:
    """transformers' ``tojson(x, ensure_ascii, indent, separators, sort_keys)``."""
    indent = args[1] if len(args) > 1 else kwargs.get("indent")
    separators = args[2] if len(args) > 2 else kwargs.get("separators")
    padding = _width(indent) + sum(_width(s) for s in separators if isinstance(s, str)) \
        if isinstance(separators, (list, tuple)) else _width(indent)
    return bounds.size(value) * (1 + padding)


def _sum_size(bounds: Bounds, value: Any, args: tuple, kwargs: dict) -> int:
    """``sum`` of lists adds them one by one, copying the total so far each time: its work."""
    start = args[1] if len(args) > 1 else kwargs.get("start", 0)
    if not isinstance(start, (list, tuple)):
        return 0
    lengths = [len(item) if isinstance(item, (list, tuple)) else 1 for item in value]
    return len(lengths) * (sum(lengths) + len(start))


# Per filter that writes text: the length of its result, estimated from its value and arguments.
_TEXT_FILTERS = ("capitalize", "e", "escape", "forceescape", "lower", "pprint", "safe", "string", "striptags",
                 "title", "trim", "truncate", "upper", "urlencode", "urlize", "wordcount", "xmlattr")
FILTER_SIZES: Dict[str, Callable[[Bounds, Any, tuple, dict], int]] = {
    **{name: (lambda b, v, a, k: b.size(v)) for name in _TEXT_FILTERS},
    "center": lambda b, v, a, k: max(b.size(v), _int_or(_first(a, k, "width", 80), 0)),
    "indent": lambda b, v, a, k: _indented_size(b, v, _first(a, k, "width", 4)),
    "format": lambda b, v, a, k: b.size(v) + b.size(a) + b.size(k) + (
        percent_width(v, a or k) if isinstance(v, str) else 0),
    "join": lambda b, v, a, k: b.size(v) + _width(_first(a, k, "d", "")) * len(v),
    "replace": _replace_filter_size,
    "wordwrap": lambda b, v, a, k: b.size(v) * (1 + _width(a[2] if len(a) > 2 else k.get("wrapstring") or "")),
    "tojson": _json_size,
    "batch": lambda b, v, a, k: _int_or(_first(a, k, "linecount", 0), 0),
    "sum": _sum_size,
}
_ITERATOR_FILTERS = ("join", "sum")  # their estimates read the value, so an iterator is read into a list first


def bounded_filter(name: str, function: Callable, bounds: Bounds) -> Callable:
    """``function`` (a filter) checked before it runs; Jinja still passes it what it asks for
    (its context or environment first), as ``wraps`` keeps the mark that asks."""
    skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0
    estimate = FILTER_SIZES[name]

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        value, rest = args[skip], args[skip + 1:]
        if name in _ITERATOR_FILTERS and not isinstance(value, (str, list, tuple, dict)):
            value = list(value)  # an iterator, read once
            args = args[:skip] + (value,) + rest
        bounds.check(estimate(bounds, value, rest, kwargs), f"a string (with the {name} filter)")
        return function(*args, **kwargs)

    return bounded
