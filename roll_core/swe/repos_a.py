"""Repository templates of the SWE task generator (part 1): text utilities, an inventory
model, intervals and dates, a matrix library.

A template is a small pure-Python package with its own passing pytest suite and *probes*:
snippets whose last line is an expression, run against the original code to make the hidden
tests (``assert <expression> == <value on the original>``). See
:mod:`roll_core.swe.generate`.
"""

from __future__ import annotations

from roll_core.swe.template import RepoTemplate

TEXTKIT = RepoTemplate(
    name="textkit",
    files={
        "textkit/__init__.py": '"""Small text utilities."""\n',
        "textkit/case.py": '''"""Changing the case of identifiers and titles."""


def snake_case(text):
    """'HelloWorld' and 'hello world' -> 'hello_world'."""
    out = []
    for i, ch in enumerate(text):
        if ch.isupper() and i > 0 and text[i - 1].isalnum() and not text[i - 1].isupper():
            out.append("_")
        out.append("_" if ch in " -" else ch.lower())
    return "".join(out)


def camel_case(text, upper_first=False):
    """'hello_world' -> 'helloWorld' ('HelloWorld' with upper_first)."""
    parts = [p for p in text.replace("-", "_").split("_") if p]
    if not parts:
        return ""
    head = parts[0].capitalize() if upper_first else parts[0].lower()
    return head + "".join(p.capitalize() for p in parts[1:])


def title_words(text, small=("a", "an", "the", "of", "and")):
    """Capitalise every word except small ones that are not first or last."""
    words = text.split()
    out = []
    for i, word in enumerate(words):
        if 0 < i < len(words) - 1 and word.lower() in small:
            out.append(word.lower())
        else:
            out.append(word[:1].upper() + word[1:].lower())
    return " ".join(out)
''',
        "textkit/wrap.py": '''"""Wrapping, truncating and padding lines."""


def wrap(text, width):
    """Greedy word wrap: lines of at most ``width`` characters (longer words alone)."""
    lines, line = [], ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line = line + " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def truncate(text, limit, ellipsis="..."):
    """At most ``limit`` characters, ending in ``ellipsis`` when cut."""
    if len(text) <= limit:
        return text
    keep = max(limit - len(ellipsis), 0)
    return text[:keep] + ellipsis


def pad_center(text, width, fill=" "):
    """Centre ``text`` in ``width`` characters; the extra one goes to the right."""
    missing = width - len(text)
    if missing <= 0:
        return text
    left = missing // 2
    return fill * left + text + fill * (missing - left)
''',
        "textkit/count.py": '''"""Counting words."""


def words(text):
    """Lower-case words, punctuation stripped."""
    out = []
    for raw in text.split():
        word = raw.strip(".,;:!?\\"'()").lower()
        if word:
            out.append(word)
    return out


def word_counts(text):
    """Word -> number of occurrences."""
    counts = {}
    for word in words(text):
        counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, k=3):
    """The ``k`` most frequent words as (word, count), ties by alphabetical order."""
    items = sorted(word_counts(text).items(), key=lambda kv: (-kv[1], kv[0]))
    return items[:k]


def longest_word(text):
    """The longest word (the first one among equals); '' for no words."""
    best = ""
    for word in words(text):
        if len(word) > len(best):
            best = word
    return best
''',
        "tests/test_case.py": """from textkit.case import camel_case, snake_case, title_words


def test_snake_case():
    assert snake_case("HelloWorld") == "hello_world"


def test_camel_case():
    assert camel_case("hello_world") == "helloWorld"


def test_title_words():
    assert title_words("war and peace") == "War and Peace"
""",
        "tests/test_wrap.py": """from textkit.wrap import pad_center, truncate, wrap


def test_wrap_short():
    assert wrap("one two", 20) == ["one two"]


def test_truncate_short_text_unchanged():
    assert truncate("abc", 10) == "abc"


def test_pad_center_no_room():
    assert pad_center("abcdef", 3) == "abcdef"
""",
        "tests/test_count.py": """from textkit.count import longest_word, word_counts


def test_word_counts():
    assert word_counts("a b a") == {"a": 2, "b": 1}


def test_longest_word_empty():
    assert longest_word("") == ""
""",
    },
    probes={
        "textkit.case": [
            "snake_case('parseHttpRequest')",
            "snake_case('make it-so')",
            "snake_case('already_snake')",
            "camel_case('make_it_so')",
            "camel_case('make-it-so', upper_first=True)",
            "camel_case('__x__')",
            "camel_case('')",
            "title_words('the lord of the rings')",
            "title_words('a tale of two cities')",
            "title_words('OF MICE AND MEN')",
        ],
        "textkit.wrap": [
            "wrap('the quick brown fox jumps', 10)",
            "wrap('aaaa bbbb cccc', 9)",
            "wrap('a b c d e f', 3)",
            "wrap('supercalifragilistic is long', 5)",
            "wrap('', 4)",
            "truncate('hello world', 8)",
            "truncate('hello world', 11)",
            "truncate('hello world', 2)",
            "truncate('abcdef', 5, ellipsis='~')",
            "pad_center('ab', 7)",
            "pad_center('abc', 7, fill='*')",
            "pad_center('x', 2, '-')",
        ],
        "textkit.count": [
            "words('Hello, world! Hello?')",
            "word_counts('The cat and the hat.')",
            "top_words('b a b c a b d', 2)",
            "top_words('x y z y x y')",
            "top_words('one two three four', 4)",
            "longest_word('a bb ccc dd eee')",
            "longest_word('Tiny, enormous; big.')",
        ],
    },
)

INVENTORY = RepoTemplate(
    name="inventory",
    files={
        "inventory/__init__.py": '"""A stock-keeping model."""\n',
        "inventory/model.py": '''"""Items and an inventory of them (prices in cents)."""


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, qty, price_cents):
        """Add ``qty`` units (a new item takes the price; an existing one keeps its own)."""
        if qty <= 0:
            raise ValueError("quantity must be positive")
        if name in self.items:
            self.items[name][0] += qty
        else:
            self.items[name] = [qty, price_cents]
        return self

    def remove(self, name, qty):
        """Take ``qty`` units out; ValueError when there are not enough."""
        have = self.items.get(name, [0, 0])[0]
        if qty > have:
            raise ValueError(f"only {have} of {name} in stock")
        self.items[name][0] = have - qty
        if self.items[name][0] == 0:
            del self.items[name]
        return self

    def count(self, name):
        return self.items.get(name, [0, 0])[0]

    def total_value(self):
        """Sum of quantity times price over all items, cents."""
        return sum(qty * price for qty, price in self.items.values())

    def low_stock(self, threshold=5):
        """Names with fewer than ``threshold`` units, sorted."""
        return sorted(name for name, (qty, _) in self.items.items() if qty < threshold)

    def restock_plan(self, target=10):
        """How many units of each item reach ``target`` (items at or above it left out)."""
        plan = {}
        for name, (qty, _) in self.items.items():
            if qty < target:
                plan[name] = target - qty
        return plan
''',
        "inventory/pricing.py": '''"""Discounts, tiers and tax in integer cents."""


def apply_discount(cents, percent):
    """Price after a ``percent`` discount, rounded half up to a cent."""
    if not 0 <= percent <= 100:
        raise ValueError("percent must be in 0..100")
    return (cents * (100 - percent) + 50) // 100


def bulk_price(unit_cents, qty, tiers=((10, 5), (50, 10))):
    """Total for ``qty`` units: the largest tier (min quantity, percent off) reached applies."""
    percent = 0
    for min_qty, off in tiers:
        if qty >= min_qty:
            percent = off
    return apply_discount(unit_cents * qty, percent)


def with_tax(cents, rate_bp=800):
    """``cents`` plus tax at ``rate_bp`` basis points, rounded half up."""
    return cents + (cents * rate_bp + 5000) // 10000


def split_bill(cents, people):
    """Shares that add up to ``cents``; the first ones carry the extra cents."""
    if people < 1:
        raise ValueError("at least one person")
    base, extra = divmod(cents, people)
    return [base + 1 if i < extra else base for i in range(people)]
''',
        "tests/test_model.py": """import pytest

from inventory.model import Inventory


def test_add_and_count():
    inv = Inventory().add("bolt", 3, 25)
    assert inv.count("bolt") == 3


def test_remove_too_many():
    with pytest.raises(ValueError):
        Inventory().add("nut", 1, 5).remove("nut", 2)
""",
        "tests/test_pricing.py": """from inventory.pricing import apply_discount, split_bill


def test_no_discount():
    assert apply_discount(1000, 0) == 1000


def test_split_even():
    assert split_bill(900, 3) == [300, 300, 300]
""",
    },
    probes={
        "inventory.model": [
            "inv = Inventory().add('bolt', 3, 25).add('nut', 10, 5)\ninv.total_value()",
            "inv = Inventory().add('bolt', 3, 25).add('bolt', 2, 99)\n(inv.count('bolt'), inv.total_value())",
            "inv = Inventory().add('a', 4, 1).add('b', 5, 1).add('c', 6, 1)\ninv.low_stock()",
            "inv = Inventory().add('a', 4, 1).add('b', 5, 1)\ninv.low_stock(threshold=6)",
            "inv = Inventory().add('a', 3, 1).add('b', 10, 1).add('c', 12, 1)\ninv.restock_plan()",
            "inv = Inventory().add('a', 3, 1)\ninv.restock_plan(target=3)",
            "inv = Inventory().add('a', 3, 1).remove('a', 3)\n(inv.count('a'), 'a' in inv.items)",
            "inv = Inventory().add('a', 5, 2).remove('a', 2)\ninv.total_value()",
        ],
        "inventory.pricing": [
            "apply_discount(999, 10)",
            "apply_discount(1000, 100)",
            "apply_discount(1, 50)",
            "bulk_price(100, 9)",
            "bulk_price(100, 10)",
            "bulk_price(100, 60)",
            "bulk_price(100, 50, tiers=((50, 20),))",
            "with_tax(1000)",
            "with_tax(1234, rate_bp=1000)",
            "with_tax(1)",
            "split_bill(1000, 3)",
            "split_bill(5, 4)",
        ],
    },
)

INTERVALS = RepoTemplate(
    name="intervals",
    files={
        "intervals/__init__.py": '"""Half-open intervals and calendar dates."""\n',
        "intervals/core.py": '''"""Half-open integer intervals (start, end): start included, end excluded."""


def length(iv):
    return max(iv[1] - iv[0], 0)


def overlaps(a, b):
    """Whether two intervals share at least one point."""
    return a[0] < b[1] and b[0] < a[1]


def contains(iv, x):
    return iv[0] <= x < iv[1]


def merge(intervals):
    """Overlapping or touching intervals merged, sorted by start."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total_length(intervals):
    return sum(length(iv) for iv in merge(intervals))


def gaps(intervals, start, end):
    """The parts of [start, end) no interval covers."""
    out = []
    cursor = start
    for s, e in merge(intervals):
        if s > cursor:
            out.append((cursor, min(s, end)))
        cursor = max(cursor, e)
        if cursor >= end:
            break
    if cursor < end:
        out.append((cursor, end))
    return out
''',
        "intervals/dates.py": '''"""Proleptic Gregorian dates as (year, month, day) tuples."""

DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def is_leap(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    if month == 2 and is_leap(year):
        return 29
    return DAYS[month - 1]


def day_of_year(year, month, day):
    """1 for January 1st."""
    return sum(days_in_month(year, m) for m in range(1, month)) + day


def add_days(date, n):
    """The date ``n`` days later (n >= 0)."""
    year, month, day = date
    day += n
    while day > days_in_month(year, month):
        day -= days_in_month(year, month)
        month += 1
        if month > 12:
            month = 1
            year += 1
    return (year, month, day)


def weekday(year, month, day):
    """0 for Monday .. 6 for Sunday (Zeller's congruence)."""
    if month < 3:
        month += 12
        year -= 1
    k, j = year % 100, year // 100
    h = (day + 13 * (month + 1) // 5 + k + k // 4 + j // 4 + 5 * j) % 7
    return (h + 5) % 7
''',
        "tests/test_core.py": """from intervals.core import contains, merge, overlaps


def test_overlaps():
    assert overlaps((0, 5), (3, 8))


def test_merge_disjoint():
    assert merge([(5, 6), (0, 1)]) == [(0, 1), (5, 6)]


def test_contains_start():
    assert contains((2, 4), 2)
""",
        "tests/test_dates.py": """from intervals.dates import day_of_year, is_leap


def test_leap():
    assert is_leap(2024)


def test_day_of_year_first():
    assert day_of_year(2023, 1, 1) == 1
""",
    },
    probes={
        "intervals.core": [
            "overlaps((0, 5), (5, 8))",
            "overlaps((3, 9), (0, 4))",
            "contains((2, 4), 4)",
            "length((7, 3))",
            "merge([(0, 3), (3, 5), (7, 9)])",
            "merge([(1, 10), (2, 3), (9, 12)])",
            "total_length([(0, 4), (2, 6), (10, 11)])",
            "gaps([(2, 4), (6, 8)], 0, 10)",
            "gaps([(0, 10)], 2, 5)",
            "gaps([(3, 5)], 0, 4)",
            "gaps([], 1, 3)",
        ],
        "intervals.dates": [
            "[is_leap(y) for y in (1900, 2000, 2023, 2024)]",
            "days_in_month(2024, 2)",
            "days_in_month(2023, 12)",
            "day_of_year(2024, 3, 1)",
            "day_of_year(2023, 12, 31)",
            "add_days((2023, 12, 30), 3)",
            "add_days((2024, 2, 28), 1)",
            "add_days((2023, 1, 31), 28)",
            "add_days((2023, 5, 5), 0)",
            "weekday(2024, 1, 1)",
            "weekday(2000, 2, 29)",
            "[weekday(2023, 3, d) for d in range(1, 8)]",
        ],
    },
)

MATRIX = RepoTemplate(
    name="matrix",
    files={
        "matrix/__init__.py": '"""Lists-of-lists matrices."""\n',
        "matrix/ops.py": '''"""Elementary matrix operations on lists of rows."""


def zeros(rows, cols):
    return [[0] * cols for _ in range(rows)]


def identity(n):
    out = zeros(n, n)
    for i in range(n):
        out[i][i] = 1
    return out


def shape(m):
    return (len(m), len(m[0]) if m else 0)


def transpose(m):
    rows, cols = shape(m)
    return [[m[r][c] for r in range(rows)] for c in range(cols)]


def add(a, b):
    if shape(a) != shape(b):
        raise ValueError("shapes differ")
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def scale(m, k):
    return [[k * x for x in row] for row in m]


def matmul(a, b):
    (n, k), (k2, p) = shape(a), shape(b)
    if k != k2:
        raise ValueError("inner dimensions differ")
    out = zeros(n, p)
    for i in range(n):
        for j in range(p):
            out[i][j] = sum(a[i][t] * b[t][j] for t in range(k))
    return out


def trace(m):
    return sum(m[i][i] for i in range(min(shape(m))))
''',
        "matrix/algebra.py": '''"""Determinants, powers and symmetry."""

from matrix.ops import identity, matmul, shape, transpose


def minor(m, i, j):
    """``m`` without row i and column j."""
    return [row[:j] + row[j + 1 :] for r, row in enumerate(m) if r != i]


def det(m):
    """Laplace expansion along the first row."""
    n = len(m)
    if n == 1:
        return m[0][0]
    if n == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    total = 0
    for j in range(n):
        sign = -1 if j % 2 else 1
        total += sign * m[0][j] * det(minor(m, 0, j))
    return total


def power(m, k):
    """``m`` to the ``k``-th power (k >= 0) by repeated squaring."""
    result = identity(len(m))
    base = m
    while k > 0:
        if k % 2 == 1:
            result = matmul(result, base)
        base = matmul(base, base)
        k //= 2
    return result


def is_symmetric(m):
    rows, cols = shape(m)
    return rows == cols and transpose(m) == m


def row_sums(m):
    return [sum(row) for row in m]
''',
        "tests/test_ops.py": """from matrix.ops import identity, transpose


def test_identity():
    assert identity(2) == [[1, 0], [0, 1]]


def test_transpose_square():
    assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]
""",
        "tests/test_algebra.py": """from matrix.algebra import det, is_symmetric


def test_det_one():
    assert det([[7]]) == 7


def test_symmetric_identity():
    assert is_symmetric([[1, 0], [0, 1]])
""",
    },
    probes={
        "matrix.ops": [
            "zeros(2, 3)",
            "transpose([[1, 2, 3], [4, 5, 6]])",
            "shape([[1, 2, 3]])",
            "add([[1, 2]], [[10, 20]])",
            "scale([[1, -2], [3, 0]], 3)",
            "matmul([[1, 2], [3, 4]], [[5, 6], [7, 8]])",
            "matmul([[1, 2, 3]], [[1], [0], [2]])",
            "trace([[1, 2, 3], [4, 5, 6], [7, 8, 9]])",
            "trace([[1, 2, 3], [4, 5, 6]])",
            "identity(3)",
        ],
        "matrix.algebra": [
            "minor([[1, 2, 3], [4, 5, 6], [7, 8, 10]], 1, 2)",
            "det([[1, 2], [3, 4]])",
            "det([[2, 0, 1], [1, 3, 2], [1, 1, 1]])",
            "det([[1, 2, 3], [4, 5, 6], [7, 8, 10]])",
            "power([[1, 1], [1, 0]], 5)",
            "power([[2, 0], [0, 3]], 0)",
            "power([[1, 2], [0, 1]], 3)",
            "is_symmetric([[1, 2], [2, 1]])",
            "is_symmetric([[1, 2], [3, 1]])",
            "is_symmetric([[1, 2, 3]])",
            "row_sums([[1, 2], [3, 4], [5, 6]])",
        ],
    },
)
