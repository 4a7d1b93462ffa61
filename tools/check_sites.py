# SPDX-License-Identifier: Apache-2.0
"""Check shm-embeds' vLLM hook sites statically against a vLLM source tree.

Takes the site list from ``vllm._shm_embeds_glue.SITES`` and, for each site,
parses the module file of the given tree with ``ast`` (nothing of that tree is
imported, so a CUDA wheel can be checked on a CPU machine): the class and
method must exist, accept the listed parameters and contain the listed source
marks. This is how vllm 0.33.x is checked here:

    pip download --no-deps vllm==0.33.0 -d /tmp/w
    python -m zipfile -e /tmp/w/vllm-0.33.0-*.whl /tmp/w/src
    python tools/check_sites.py /tmp/w/src/vllm

Exit status 0 when every site holds, 1 otherwise.
"""

import argparse
import ast
import os
import sys


def site_files(module: str) -> list[str]:
    """Paths (relative to the vLLM package dir) a module may live in."""
    rel = module.split(".", 1)[1].replace(".", os.sep)
    return [rel + ".py", os.path.join(rel, "__init__.py")]


def check_site(vllm_dir: str, hop, module, qualname, params=(), marks=(),
               alt_modules=()) -> str | None:
    """Problem with one site in the tree at ``vllm_dir``, or None.

    ``alt_modules``: the same site under other module paths (first that has
    the file wins); a ``qualname`` without a dot is a module-level function.
    """
    for mod in (module, *alt_modules):
        path = next((os.path.join(vllm_dir, r) for r in site_files(mod)
                     if os.path.exists(os.path.join(vllm_dir, r))), None)
        if path is not None:
            return _check_in(path, mod, qualname, params, marks)
    return f"{module}: no file {site_files(module)[0]}"


def _check_params_marks(source, item, qualname, params, marks) -> str | None:
    a = item.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    missing = [p for p in params if p not in names]
    if missing:
        return f"{qualname}: lacks parameter(s) {missing}"
    body = ast.get_source_segment(source, item) or ""
    absent = [m for m in marks if m not in body]
    if absent:
        return f"{qualname}: no longer contains {absent}"
    return None


def _check_in(path, module, qualname, params, marks) -> str | None:
    source = open(path).read()
    if "." not in qualname:
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == qualname:
                return _check_params_marks(source, node, qualname, params, marks)
        return f"{module}: no function {qualname}"
    cls_name, meth = qualname.split(".")
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == meth:
                    return _check_params_marks(source, item, qualname, params, marks)
            return f"{qualname}: no method {meth}"
    return f"{module}: no class {cls_name}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("vllm_dir", help="path of a vLLM package directory (…/vllm)")
    args = p.parse_args()
    from vllm._shm_embeds_glue import BINARY_SITES, JSON_SITES, METRICS_SITES, SITES

    bad = 0
    for key, s in {**SITES, **BINARY_SITES, **JSON_SITES, **METRICS_SITES}.items():
        problem = check_site(args.vllm_dir, s.hop, s.module, s.qualname, s.params,
                             s.source_marks, getattr(s, "alt_modules", ()))
        print(f"{'FAIL' if problem else 'ok  '} {key:18} {s.module}.{s.qualname}"
              + (f": {problem}" if problem else ""))
        bad += problem is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
