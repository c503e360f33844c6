"""One idea per line, in the files a reader reads (pyproject.toml's [tool.ruff] include): ruff's rules,
then the ones ruff has no code for, from the syntax tree. And detour.py stays self-contained: the copy a
run saves imports nothing of this repository."""
import ast
import glob
import os
import subprocess
import sys

import pytest

from conftest import ROOT

LINTED = sorted({p for pattern in ("detour.py", "finetune.py", "data/*.py", "studies/analysis.py",
                                   "studies/ablation.py")
                 for p in glob.glob(os.path.join(ROOT, pattern))})
LONGEST_FUNCTION = 60
LONGEST_LOOP = 80  # detour.train, the training loop, reads best in one piece
RUN_TIME = {"torch", "numpy", "tokenizers", "tqdm"}
OPTIONAL = {"wandb"}  # imported inside the function that uses it, only when asked for


def trees():
    for path in LINTED:
        with open(path) as f:
            yield os.path.relpath(path, ROOT), ast.parse(f.read())


def test_ruff_is_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_nested_conditional_expression():
    nested = [f"{path}:{node.lineno}" for path, tree in trees() for node in ast.walk(tree)
              if isinstance(node, ast.IfExp)
              and any(isinstance(sub, ast.IfExp) for sub in ast.walk(node) if sub is not node)]
    assert not nested, f"a conditional expression inside another: {nested}"


def test_no_tuple_packing_but_swaps():
    """`a, b = x, y` packs two ideas into one statement; a swap (`a, b = b, a`) is one idea."""
    def packs(node):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)):
            return False
        target = node.targets[0]
        if not isinstance(target, ast.Tuple):
            return False
        names = sorted(ast.dump(e) for e in target.elts)
        return names != sorted(ast.dump(e) for e in node.value.elts)

    packed = [f"{path}:{node.lineno}" for path, tree in trees() for node in ast.walk(tree) if packs(node)]
    assert not packed, f"tuple assignments of several values (one a line, please): {packed}"


def test_functions_are_short():
    long = []
    for path, tree in trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = LONGEST_LOOP if (path, node.name) == ("detour.py", "train") else LONGEST_FUNCTION
                if node.end_lineno - node.lineno + 1 > limit:
                    long.append(f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"


def test_detour_imports_only_the_standard_library_and_its_four_packages():
    with open(os.path.join(ROOT, "detour.py")) as f:
        tree = ast.parse(f.read())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        else:
            continue
        for name in names:
            root = name.split(".")[0]
            allowed = root in sys.stdlib_module_names or root in RUN_TIME
            if not allowed and not (root in OPTIONAL and id(node) not in top):
                found.append(f"detour.py:{node.lineno} {name}")
    assert not found, f"detour.py must run alone (stdlib, {', '.join(sorted(RUN_TIME))}): {found}"


@pytest.mark.parametrize("bad, rule", [("x = 1 if a else 2 if b else 3\n", "nested"),
                                       ("a, b = 1, 2\n", "packing")])
def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch, bad, rule):
    """The syntax-tree checks fail on the code they forbid (a check that cannot fail checks nothing)."""
    path = tmp_path / "bad.py"
    path.write_text(bad)
    monkeypatch.setattr(sys.modules[__name__], "LINTED", [str(path)])
    check = {"nested": test_no_nested_conditional_expression, "packing": test_no_tuple_packing_but_swaps}[rule]
    with pytest.raises(AssertionError):
        check()
