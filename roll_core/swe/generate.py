"""``roll data swe``: SWE-style tasks generated from a seed, each verified in the sandbox.

For each repository template (:mod:`roll_core.swe.repos_a`, :mod:`~.repos_b`):

1. its probes run on the original code in a sandbox; their values become the hidden tests
   (``tests/test_<module>_issue.py``: ``assert <expression> == <value>``), and the original
   with every hidden test must pass its whole suite (else the template is broken: an error);
2. every function is put in the train or the held-out split (a seeded shuffle, about
   ``held_out`` of each template's functions held out), so the splits share no function;
3. every mutant of every function (:mod:`roll_core.swe.mutate`) is a candidate; the
   candidates are shuffled with the seed, taken round robin over the mutation operators
   (so the many off-by-one sites do not crowd out the rare kinds) and verified in that
   order, in parallel, until ``count`` qualify. Verifying runs the probes (2 s each; a hang drops the mutant) and the
   whole suite with the module's hidden tests on the mutant, in a sandbox. A mutant
   qualifies when at least one hidden test fails and the pytest verdicts agree with the
   probes; fail-to-pass = the failing tests (hidden, and visible ones the bug breaks),
   pass-to-pass = every other test;
4. the issue text shows the first failing probe's snippet and what it gives against what is
   expected (a value, an exception): the symptom, never the fix.

The same seed gives the same tasks (the verdicts do not depend on timing: a probe either
finishes well within its 2 s or loops).
"""

from __future__ import annotations

import ast
import json
import random
import shlex
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError, DataError
from roll_core.sandbox.base import SandboxBackend, SandboxSpec
from roll_core.sandbox.diff import diff_paths
from roll_core.sandbox.local import LocalBackend
from roll_core.swe.grading import parse_pytest, pytest_command, run_tests
from roll_core.swe.mutate import Mutant, mutants
from roll_core.swe.repos_a import INTERVALS, INVENTORY, MATRIX, TEXTKIT
from roll_core.swe.repos_b import PQUEUE, STATS, TOKLIB
from roll_core.swe.task import write_task
from roll_core.swe.template import RepoTemplate

__all__ = ["TEMPLATES", "GenerateReport", "generate_swe_tasks", "pick_templates"]

TEMPLATES: tuple[RepoTemplate, ...] = (TEXTKIT, INVENTORY, INTERVALS, MATRIX, TOKLIB, PQUEUE, STATS)
PROBE_MARK = "@@ROLL-PROBES@@"
PROBE_RUNNER = r"""
import ast, importlib, json, signal, sys
class Hang(Exception):
    pass
def _alarm(*_):
    raise Hang()
signal.signal(signal.SIGALRM, _alarm)
out, hung = {}, False
for name, snippets in json.loads(sys.argv[1]).items():
    module = importlib.import_module(name)
    results = out[name] = []
    for snippet in snippets:
        scope = dict(vars(module))
        tree = ast.parse(snippet)
        last = tree.body.pop()
        signal.alarm(2)
        try:
            exec(compile(tree, "<probe>", "exec"), scope)
            value = eval(compile(ast.Expression(last.value), "<probe>", "eval"), scope)
            results.append(["ok", repr(value)])
        except Hang:
            results.append(["hang", "it never returns"]); hung = True
        except Exception as err:
            results.append(["raise", f"{type(err).__name__}: {err}"])
        finally:
            signal.alarm(0)
print("@@ROLL-PROBES@@" + json.dumps(out))
sys.exit(3 if hung else 0)
"""


def pick_templates(names: list[str] | None) -> tuple[RepoTemplate, ...]:
    """The templates named (all of them for None); an unknown name is a ConfigError."""
    if not names:
        return TEMPLATES
    by_name = {t.name: t for t in TEMPLATES}
    unknown = [n for n in names if n.strip() not in by_name]
    if unknown:
        raise ConfigError(
            f"unknown SWE repository {', '.join(map(repr, unknown))}.",
            hint=f"Repositories: {', '.join(by_name)}.",
        )
    return tuple(by_name[n.strip()] for n in dict.fromkeys(names))


@dataclass(frozen=True)
class GenerateReport:
    """What ``roll data swe`` wrote."""

    out_dir: Path
    train: int
    test: int
    candidates_tried: int
    dropped: int
    seconds_per_check: float


@dataclass(frozen=True)
class _Candidate:
    template: RepoTemplate
    module_path: str
    mutant: Mutant

    @property
    def module(self) -> str:
        return self.module_path[: -len(".py")].replace("/", ".")

    @property
    def function_key(self) -> str:
        return f"{self.template.name}:{self.module}:{self.mutant.function}"

    @property
    def task_id(self) -> str:
        fn = self.mutant.function.replace(".", "_").strip("_")
        mod = self.module.rsplit(".", 1)[-1]
        return f"{self.template.name}__{mod}__{fn}__{self.mutant.op}_{self.mutant.site}"


def _hidden_file(module: str, snippets: list[str], values: list[str]) -> tuple[str, str]:
    name = module.split(".")[-1]
    lines = [f"from {module} import *  # noqa: F403", ""]
    for i, (snippet, value) in enumerate(zip(snippets, values, strict=True)):
        *body, last = snippet.splitlines()
        lines += ["", f"def test_{name}_issue_{i}():"]
        lines += ["    " + b for b in body]
        lines += [f"    assert ({last}) == {value}", ""]
    return f"tests/test_{name}_issue.py", "\n".join(lines).rstrip() + "\n"


def _probe_command(probes: dict[str, list[str]]) -> str:
    return f"python -c {shlex.quote(PROBE_RUNNER)} {shlex.quote(json.dumps(probes))}"


def _probe_results(output: str) -> dict[str, list[list[str]]] | None:
    """Module -> the probes' results (None when one hangs)."""
    for line in output.splitlines():
        if line.startswith(PROBE_MARK):
            data = json.loads(line[len(PROBE_MARK) :])
            hung = any(kind == "hang" for results in data.values() for kind, _ in results)
            return None if hung else data
    raise DataError(f"the SWE probe runner failed: {output[-1000:]}")


def _test_ids(files: dict[str, str]) -> list[str]:
    """The visible tests' node ids: top-level ``test_*`` functions of ``tests/test_*.py``."""
    ids = []
    for path in sorted(files):
        if path.startswith("tests/test_") and path.endswith(".py"):
            tree = ast.parse(files[path])
            ids += [f"{path}::{node.name}" for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]  # fmt: skip
    return ids


class _Generator:
    def __init__(self, backend: SandboxBackend, spec: SandboxSpec, work: Path) -> None:
        self.backend, self.spec, self.work = backend, spec, work
        self.expected: dict[tuple[str, str], list[str]] = {}
        self.hidden: dict[tuple[str, str], tuple[str, str]] = {}
        self.visible: dict[str, list[str]] = {}

    def prepare(self, template: RepoTemplate) -> None:
        """Step 1 of the module docstring."""
        base = self.work / template.name
        for rel, text in template.files.items():
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_text(text, encoding="utf-8")
        self.visible[template.name] = _test_ids(template.files)
        with self.backend.create(base, self.spec) as box:
            result = box.exec(_probe_command(template.probes), timeout=120)
            found = _probe_results(result.output())
            for module, snippets in template.probes.items():
                results = (found or {}).get(module, [])
                if len(results) != len(snippets) or any(k != "ok" for k, _ in results):
                    raise DataError(
                        f"SWE template {template.name}: a probe of {module} fails: {results}"
                    )
                values = [value for _, value in results]
                for value in values:
                    ast.literal_eval(value)  # a literal the hidden test can compare with
                self.expected[(template.name, module)] = values
                path, text = _hidden_file(module, snippets, values)
                self.hidden[(template.name, module)] = (path, text)
                box.write_file(path, text)
            ids = self.visible[template.name] + self._hidden_ids(template.name)
            verdict, tail = run_tests(box, ids, timeout=120)
        if not ids or not all(verdict.values()):
            raise DataError(f"SWE template {template.name}: its tests do not pass: {tail}")

    def _hidden_ids(self, template: str, module: str | None = None) -> list[str]:
        ids = []
        for (t, m), (path, text) in sorted(self.hidden.items()):
            if t == template and module in (None, m):
                ids += [f"{path}::{line[4:].split('(')[0]}" for line in text.splitlines()
                        if line.startswith("def test_")]  # fmt: skip
        return ids

    def verify(self, cand: _Candidate) -> dict[str, Any] | None:
        """Step 3: the task's facts, or None when the mutant does not qualify."""
        t, module = cand.template, cand.module
        src = self.work / f"{cand.task_id}-src"
        shutil.copytree(self.work / t.name, src)
        (src / cand.module_path).write_text(cand.mutant.source, encoding="utf-8")
        path, text = self.hidden[(t.name, module)]
        (src / path).write_text(text, encoding="utf-8")
        hidden = self._hidden_ids(t.name, module)
        ids = self.visible[t.name] + hidden
        probes = _probe_command({module: t.probes[module]})
        try:
            with self.backend.create(src, self.spec) as box:  # probes, then (no hang) tests
                result = box.exec(f"{probes} && {pytest_command(ids)}", timeout=120)
        finally:
            shutil.rmtree(src, ignore_errors=True)
        found = _probe_results(result.stdout)
        if found is None:
            return None
        results = found[module]
        verdict = parse_pytest(result.stdout, ids, result.timed_out)
        expected = self.expected[(t.name, module)]
        wrong = [
            i for i, (kind, value) in enumerate(results) if (kind, value) != ("ok", expected[i])
        ]
        if not wrong or [not verdict[hidden[i]] for i in range(len(hidden))] != [
            i in wrong for i in range(len(hidden))
        ]:
            return None  # no hidden test fails, or pytest disagrees with the probes
        f2p = [tid for tid, ok in verdict.items() if not ok]
        p2p = [tid for tid, ok in verdict.items() if ok]
        first = wrong[0]
        return {
            "FAIL_TO_PASS": f2p,
            "PASS_TO_PASS": p2p,
            "symptom": (t.probes[module][first], results[first], expected[first]),
            "module": module,
        }


def issue_text(
    module: str, snippet: str, actual: list[str], expected: str, rng: random.Random
) -> str:
    """The issue: the failing snippet, what it gives, what was expected (never the fix)."""
    *body, last = snippet.splitlines()
    code = "\n".join([f"from {module} import *", *body, f"print(repr({last}))"])
    kind, value = actual
    got = f"raises `{value}`" if kind == "raise" else f"prints `{value}`"
    title = rng.choice(
        [
            f"Wrong result from `{module}`",
            f"Unexpected output in `{module}`",
            f"`{module}` misbehaves on a simple input",
            f"Bug report: `{module}`",
        ]
    )
    opener = rng.choice(
        [
            "I ran into this while using the library:",
            "This snippet reproduces the problem:",
            "Minimal example:",
            "Steps to reproduce:",
        ]
    )
    closer = rng.choice(
        [
            f"It {got}, but I expected `{expected}`.",
            f"Expected `{expected}`, but it {got}.",
            f"The output should be `{expected}`; instead it {got}.",
        ]
    )
    return f"{title}\n\n{opener}\n\n```python\n{code}\n```\n\n{closer}\n"


def _interleave_ops(candidates: list[_Candidate]) -> list[_Candidate]:
    """Round robin over the mutation operators (each in its shuffled order), so that the
    common ones (off-by-one constants are everywhere) do not crowd out the rare ones."""
    groups: dict[str, list[_Candidate]] = {}
    for cand in candidates:
        groups.setdefault(cand.mutant.op, []).append(cand)
    out: list[_Candidate] = []
    queues = [groups[op] for op in sorted(groups)]
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


def _split(templates: tuple[RepoTemplate, ...], held_out: float, rng: random.Random) -> set[str]:
    """The held-out functions: about ``held_out`` of each template's, at least one."""
    test: set[str] = set()
    for t in templates:
        keys = sorted(
            {f"{t.name}:{m[:-3].replace('/', '.')}:{x.function}" for m in t.modules()
             for x in mutants(t.files[m])}
        )  # fmt: skip
        rng.shuffle(keys)
        test |= set(keys[: max(1, round(held_out * len(keys)))])
    return test


def generate_swe_tasks(
    out_dir: Path,
    *,
    seed: int = 0,
    count: int = 240,
    held_out: float = 0.2,
    backend: SandboxBackend | None = None,
    spec: SandboxSpec | None = None,
    progress: Callable[[int, int], None] | None = None,
    templates: tuple[RepoTemplate, ...] = TEMPLATES,
) -> GenerateReport:
    """Write ``count`` verified tasks under ``out_dir/train`` and ``out_dir/test`` (see the
    module docstring) and ``out_dir/manifest.json``; ``templates``: the repositories to use
    (default: all of them)."""
    import time

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DataError(f"{out_dir} is not empty", hint="Pass a new or empty directory.")
    backend = backend or LocalBackend()
    spec = spec or SandboxSpec(memory_mb=1024, cpu_s=60)
    rng = random.Random(seed)
    held = _split(templates, held_out, rng)
    candidates = [
        _Candidate(t, m, x) for t in templates for m in t.modules() for x in mutants(t.files[m])
    ]
    rng.shuffle(candidates)
    candidates = _interleave_ops(candidates)
    work = Path(tempfile.mkdtemp(prefix="roll-swe-gen-"))
    chosen: list[tuple[_Candidate, dict[str, Any]]] = []
    tried, start = 0, time.perf_counter()
    try:
        gen = _Generator(backend, spec, work)
        workers = getattr(backend, "max_concurrent", 2)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(gen.prepare, templates))
            while len(chosen) < count and tried < len(candidates):
                batch = candidates[tried : tried + max(workers, count - len(chosen))]
                tried += len(batch)
                for cand, facts in zip(batch, pool.map(gen.verify, batch), strict=True):
                    if facts is not None and len(chosen) < count:
                        chosen.append((cand, facts))
                if progress is not None:
                    progress(len(chosen), count)
        check_seconds = (time.perf_counter() - start) / max(tried, 1)
        if len(chosen) < count:
            raise DataError(
                f"only {len(chosen)} of the {count} SWE tasks asked for qualify "
                f"({len(candidates)} candidate bugs)",
                hint="Ask for fewer tasks with --count.",
            )
        for cand, facts in chosen:
            _write(out_dir, cand, facts, gen, held, seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n_test = sum(c.function_key in held for c, _ in chosen)
    manifest: dict[str, Any] = {
        "seed": seed,
        "count": count,
        "train": count - n_test,
        "test": n_test,
    }
    manifest["tasks"] = sorted(c.task_id for c, _ in chosen)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", "utf-8")
    return GenerateReport(out_dir, count - n_test, n_test, tried, tried - count, check_seconds)


def _write(
    out_dir: Path,
    cand: _Candidate,
    facts: dict[str, Any],
    gen: _Generator,
    held: set[str],
    seed: int,
) -> None:
    t = cand.template
    split = "test" if cand.function_key in held else "train"
    repo = dict(t.files)
    repo[cand.module_path] = cand.mutant.source
    original = t.files[cand.module_path].splitlines(True)
    fix = diff_paths(cand.module_path, cand.mutant.source.splitlines(True), original)
    path, text = gen.hidden[(t.name, cand.module)]
    snippet, actual, expected = facts["symptom"]
    rng = random.Random(f"{seed}:{cand.task_id}")
    row = {
        "instance_id": cand.task_id,
        "problem_statement": issue_text(cand.module, snippet, actual, expected, rng),
        "FAIL_TO_PASS": facts["FAIL_TO_PASS"],
        "PASS_TO_PASS": facts["PASS_TO_PASS"],
        "split": split,
        "meta": {
            "template": t.name,
            "module": cand.module,
            "function": cand.mutant.function,
            "mutation": cand.mutant.op,
            "line": cand.mutant.line,
        },
    }
    write_task(out_dir / split / cand.task_id, repo_files=repo, hidden_files={path: text},
               fix=fix, row=row)  # fmt: skip
