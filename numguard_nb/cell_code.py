"""A `%%numguard` cell's code, compiled the way IPython compiles a cell, one top-level statement
at a time: the magic runs them in turn, to guard a model made by one from the next. No IPython
import: the shell is the one the magic was given."""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize

__all__ = ["compile_cell", "is_top_level_await"]


def _running_cell_number(shell) -> int:
    """The number IPython gave the cell running now (`In[5]`): that of the code that called the
    magic. (IPython 9 counts `execution_count` up before a cell runs, 7 after it.)"""
    numbers = getattr(shell.compile, "_filename_map", {})
    frame = sys._getframe(1)
    while frame is not None:
        number = numbers.get(frame.f_code.co_filename)
        if number is not None:
            return number
        frame = frame.f_back
    return shell.execution_count


def compile_cell(shell, cell: str) -> tuple:
    """A `%%numguard` cell's code, one top-level statement at a time (the last one, an
    expression, compiled to give the cell's value), compiled the way IPython compiles a cell: all
    of it before any of it runs; and the names it assigns in the namespace."""
    # A blank first line stands for the %%numguard line: tracebacks give the cell's line numbers.
    source = "\n" + shell.transform_cell(cell)
    filename = shell.compile.cache(source, _running_cell_number(shell))
    tree = shell.transform_ast(shell.compile.ast_parse(source, filename=filename))
    code = [shell.compile(ast.Module([statement], []), filename, "exec") for statement in tree.body]
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(source):
        code[-1] = shell.compile(ast.Expression(tree.body[-1].value), filename, "eval")
    return code, _assigned_names(tree)


def is_top_level_await(error: SyntaxError) -> bool:
    """Whether compiling failed on an `await` outside a function (which IPython's autoawait runs
    in a plain cell, not statement by statement)."""
    return re.match(r"'(await|async \w+)' outside", str(error.msg)) is not None


def _ends_with_semicolon(source: str) -> bool:
    """A cell whose last expression ends with ';' shows no value, as IPython's own cells."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                  if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                    tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, SyntaxError):
        return False
    return bool(tokens) and tokens[-1].string == ";"


def _assigned_names(tree: ast.Module) -> set:
    """The names a cell's code assigns in the namespace: targets of its assignments, loops,
    `with ... as`, imports (not those inside the functions and classes it defines)."""
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).partition(".")[0])
        todo.extend(ast.iter_child_nodes(node))
    return names
