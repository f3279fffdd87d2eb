"""Repository templates of the SWE task generator (part 2): a tokenizer and calculator, a
priority queue and scheduler, descriptive statistics. See :mod:`roll_core.swe.repos_a`."""

from __future__ import annotations

from roll_core.swe.template import RepoTemplate

TOKLIB = RepoTemplate(
    name="toklib",
    files={
        "toklib/__init__.py": '"""A tokenizer and an arithmetic evaluator."""\n',
        "toklib/lexer.py": '''"""Splitting source text into (kind, text) tokens."""

OPERATORS = "+-*/()^%"


def tokenize(src):
    """Numbers (with one optional dot), names, operators; whitespace skipped."""
    tokens = []
    i = 0
    while i < len(src):
        ch = src[i]
        if ch.isspace():
            i += 1
        elif ch.isdigit():
            j = i
            seen_dot = False
            while j < len(src) and (src[j].isdigit() or (src[j] == "." and not seen_dot)):
                if src[j] == ".":
                    seen_dot = True
                j += 1
            tokens.append(("num", src[i:j]))
            i = j
        elif ch.isalpha() or ch == "_":
            j = i + 1
            while j < len(src) and (src[j].isalnum() or src[j] == "_"):
                j += 1
            tokens.append(("name", src[i:j]))
            i = j
        elif ch in OPERATORS:
            tokens.append(("op", ch))
            i += 1
        else:
            raise ValueError(f"unexpected character {ch!r} at {i}")
    return tokens


def count_kinds(tokens):
    """Kind -> number of tokens of that kind."""
    counts = {}
    for kind, _ in tokens:
        counts[kind] = counts.get(kind, 0) + 1
    return counts
''',
        "toklib/calc.py": '''"""Shunting-yard to reverse Polish notation, and its evaluation."""

from toklib.lexer import tokenize

PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "%": 2, "^": 3}
RIGHT = {"^"}


def to_rpn(tokens):
    out, stack = [], []
    for kind, text in tokens:
        if kind in ("num", "name"):
            out.append(text)
        elif text == "(":
            stack.append(text)
        elif text == ")":
            while stack and stack[-1] != "(":
                out.append(stack.pop())
            if not stack:
                raise ValueError("unbalanced parenthesis")
            stack.pop()
        else:
            while stack and stack[-1] != "(":
                top = stack[-1]
                if PRECEDENCE[top] > PRECEDENCE[text] or (
                    PRECEDENCE[top] == PRECEDENCE[text] and text not in RIGHT
                ):
                    out.append(stack.pop())
                else:
                    break
            stack.append(text)
    while stack:
        if stack[-1] == "(":
            raise ValueError("unbalanced parenthesis")
        out.append(stack.pop())
    return out


def eval_rpn(rpn, names=None):
    names = names or {}
    stack = []
    for item in rpn:
        if item in PRECEDENCE:
            b = stack.pop()
            a = stack.pop()
            if item == "+":
                stack.append(a + b)
            elif item == "-":
                stack.append(a - b)
            elif item == "*":
                stack.append(a * b)
            elif item == "/":
                stack.append(a / b)
            elif item == "%":
                stack.append(a % b)
            else:
                stack.append(a**b)
        elif item[0].isdigit():
            stack.append(float(item) if "." in item else int(item))
        else:
            stack.append(names[item])
    return stack[0]


def calculate(src, **names):
    return eval_rpn(to_rpn(tokenize(src)), names)
''',
        "tests/test_lexer.py": """from toklib.lexer import tokenize


def test_simple():
    assert tokenize("1+x") == [("num", "1"), ("op", "+"), ("name", "x")]
""",
        "tests/test_calc.py": """from toklib.calc import calculate


def test_add():
    assert calculate("1 + 2") == 3


def test_name():
    assert calculate("x", x=5) == 5
""",
    },
    probes={
        "toklib.lexer": [
            "tokenize('3.14*r^2')",
            "tokenize('a_1 + b2')",
            "tokenize('1.25+x')",
            "tokenize('  (x)  ')",
            "tokenize('')",
            "count_kinds(tokenize('a + b * 2'))",
            "count_kinds([])",
        ],
        "toklib.calc": [
            "to_rpn(tokenize('1 + 2 * 3'))",
            "to_rpn(tokenize('(1 + 2) * 3'))",
            "to_rpn(tokenize('2 ^ 3 ^ 2'))",
            "to_rpn(tokenize('8 - 3 - 2'))",
            "calculate('8 - 3 - 2')",
            "calculate('2 ^ 3 ^ 2')",
            "calculate('7 % 4 * 2')",
            "calculate('10 / 4')",
            "calculate('x * (y + 1)', x=3, y=4)",
            "calculate('1.5 + 1')",
        ],
    },
)

PQUEUE = RepoTemplate(
    name="pqueue",
    files={
        "pqueue/__init__.py": '"""A binary heap and a task scheduler on it."""\n',
        "pqueue/heap.py": '''"""A binary min-heap in a list."""


def sift_up(heap, i):
    while i > 0:
        parent = (i - 1) // 2
        if heap[i] < heap[parent]:
            heap[i], heap[parent] = heap[parent], heap[i]
            i = parent
        else:
            break


def sift_down(heap, i):
    n = len(heap)
    while True:
        smallest = i
        for child in (2 * i + 1, 2 * i + 2):
            if child < n and heap[child] < heap[smallest]:
                smallest = child
        if smallest == i:
            return
        heap[i], heap[smallest] = heap[smallest], heap[i]
        i = smallest


def push(heap, item):
    heap.append(item)
    sift_up(heap, len(heap) - 1)


def pop(heap):
    """The smallest item, removed; IndexError when empty."""
    if not heap:
        raise IndexError("pop from an empty heap")
    last = heap.pop()
    if not heap:
        return last
    top = heap[0]
    heap[0] = last
    sift_down(heap, 0)
    return top


def heapify(items):
    heap = list(items)
    for i in range(len(heap) // 2 - 1, -1, -1):
        sift_down(heap, i)
    return heap


def nsmallest(items, k):
    heap = heapify(items)
    return [pop(heap) for _ in range(min(k, len(heap)))]
''',
        "pqueue/scheduler.py": '''"""Tasks by priority (lower first), first come first served among equals."""

from pqueue.heap import pop, push


class Scheduler:
    def __init__(self):
        self.heap = []
        self.counter = 0

    def add(self, task, priority=10):
        push(self.heap, (priority, self.counter, task))
        self.counter += 1
        return self

    def __len__(self):
        return len(self.heap)

    def peek(self):
        return self.heap[0][2] if self.heap else None

    def next(self):
        return pop(self.heap)[2]

    def drain(self, limit=None):
        """Tasks in order, at most ``limit`` of them."""
        out = []
        while self.heap and (limit is None or len(out) < limit):
            out.append(self.next())
        return out
''',
        "tests/test_heap.py": """from pqueue.heap import heapify, pop


def test_pop_single():
    assert pop([4]) == 4


def test_heapify_sorted_input():
    assert heapify([1, 2, 3])[0] == 1
""",
        "tests/test_scheduler.py": """from pqueue.scheduler import Scheduler


def test_peek_empty():
    assert Scheduler().peek() is None


def test_len():
    assert len(Scheduler().add("a").add("b")) == 2
""",
    },
    probes={
        "pqueue.heap": [
            "h = []\nfor x in [5, 3, 8, 1, 9, 2]:\n    push(h, x)\n[pop(h) for _ in range(6)]",
            "h = heapify([9, 4, 7, 1, 8, 2, 6])\n[pop(h) for _ in range(7)]",
            "nsmallest([5, 1, 4, 2, 3], 3)",
            "nsmallest([3, 1], 5)",
            "heapify([3, 2, 1])[0]",
            "h = [1, 5, 2]\nsift_up(h, 2)\nh",
            "h = [9, 1, 2, 3]\nsift_down(h, 0)\nh",
        ],
        "pqueue.scheduler": [
            "Scheduler().add('a', 5).add('b', 1).add('c', 3).drain()",
            "Scheduler().add('a').add('b').add('c').drain()",
            "Scheduler().add('a', 2).add('b', 2).add('c', 1).drain(limit=2)",
            "s = Scheduler().add('x', 4).add('y', 2)\n(s.peek(), len(s))",
            "s = Scheduler().add('x', 1)\n(s.next(), len(s), s.peek())",
            "Scheduler().add('a', 3).add('b', 1).add('c', 2).add('d', 1).drain()",
        ],
    },
)

STATS = RepoTemplate(
    name="stats",
    files={
        "stats/__init__.py": '"""Descriptive statistics on lists of numbers."""\n',
        "stats/center.py": '''"""Means, medians and modes."""


def mean(xs):
    if not xs:
        raise ValueError("mean of no data")
    return sum(xs) / len(xs)


def median(xs):
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("median of no data")
    mid = n // 2
    if n % 2 == 1:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2


def modes(xs):
    """The most common values, sorted."""
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    if not counts:
        return []
    top = max(counts.values())
    return sorted(x for x, c in counts.items() if c == top)


def weighted_mean(xs, weights):
    total = sum(weights)
    if total == 0:
        raise ValueError("weights sum to zero")
    return sum(x * w for x, w in zip(xs, weights)) / total
''',
        "stats/spread.py": '''"""Variance, percentiles and histograms."""

from stats.center import mean


def variance(xs, sample=True):
    """Sample variance (n - 1) by default, population variance otherwise."""
    m = mean(xs)
    n = len(xs) - 1 if sample else len(xs)
    return sum((x - m) ** 2 for x in xs) / n


def value_range(xs):
    return max(xs) - min(xs)


def percentile(xs, p):
    """Linear interpolation between closest ranks, p in 0..100."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of no data")
    pos = (len(s) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def histogram(xs, bins, lo, hi):
    """Counts in ``bins`` equal bins over [lo, hi); values outside are ignored, hi too."""
    counts = [0] * bins
    width = (hi - lo) / bins
    for x in xs:
        if lo <= x < hi:
            counts[int((x - lo) // width)] += 1
    return counts
''',
        "tests/test_center.py": """from stats.center import mean, median


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_median_single():
    assert median([4]) == 4
""",
        "tests/test_spread.py": """from stats.spread import value_range


def test_range():
    assert value_range([3, 9, 1]) == 8
""",
    },
    probes={
        "stats.center": [
            "mean([1, 2, 3, 4])",
            "median([5, 1, 3])",
            "median([4, 1, 3, 2])",
            "modes([1, 2, 2, 3, 3])",
            "modes([7])",
            "modes([])",
            "weighted_mean([1, 2, 3], [3, 0, 1])",
            "weighted_mean([10, 20], [1, 1])",
        ],
        "stats.spread": [
            "variance([2, 4, 4, 4, 5, 5, 7, 9])",
            "variance([2, 4, 4, 4, 5, 5, 7, 9], sample=False)",
            "value_range([-2, 5, 0])",
            "percentile([1, 2, 3, 4, 5], 50)",
            "percentile([10, 20, 30, 40], 25)",
            "percentile([3, 1, 2], 100)",
            "percentile([7], 30)",
            "histogram([0, 1, 2, 3, 4, 5, 9.9, 10], 5, 0, 10)",
            "histogram([-1, 0.5, 1.5], 2, 0, 2)",
        ],
    },
)
