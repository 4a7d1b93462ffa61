# SPDX-License-Identifier: Apache-2.0
"""Check every shm-embeds site (``vllm._shm_embeds.sites.SITES``) statically
against a vLLM source tree.

For each site the module file of the given tree is parsed with ``ast``
(nothing of that tree is imported, so a CUDA wheel can be checked on a CPU
machine): the class and method (or the module-level function) must exist,
accept the listed parameters and contain the listed source marks; a site
patched through a caller's global (``patch_in``) also needs that caller to
import the function by name. This is how vllm 0.33.x is checked here:

    python tools/check_sites.py --fetch 0.33.0      # download once, keep the site files
    python tools/check_sites.py /path/to/vllm       # any tree

``--fetch`` keeps only the site files of the wheel in ``.cache/vllm-<v>/``
(a later run reuses them). Exit status 0 when every site holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")


def site_files(module: str) -> list[str]:
    """Paths (relative to the vLLM package dir) a module may live in."""
    rel = module.split(".", 1)[1].replace(".", os.sep)
    return [rel + ".py", os.path.join(rel, "__init__.py")]


def _find(vllm_dir: str, module: str) -> str | None:
    return next((os.path.join(vllm_dir, r) for r in site_files(module)
                 if os.path.exists(os.path.join(vllm_dir, r))), None)


def check_site(vllm_dir: str, site) -> str | None:
    """Problem with one site (a ``Site``) in the tree at ``vllm_dir``, or None."""
    for mod in (site.module, *site.alt_modules):
        path = _find(vllm_dir, mod)
        if path is not None:
            problem = _check_in(path, mod, site.qualname, site.params, site.marks)
            if problem is None and site.patch_in:
                problem = _check_caller(vllm_dir, site.patch_in, site.qualname)
            return problem
    return f"{site.module}: no file {site_files(site.module)[0]}"


def _check_caller(vllm_dir: str, module: str, name: str) -> str | None:
    path = _find(vllm_dir, module)
    if path is None:
        return f"{module}: no file {site_files(module)[0]}"
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname is None
                                                    for a in node.names):
            return None
    return f"{module} does not import {name} by name"


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
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    if "." not in qualname:
        for node in ast.parse(source).body:
            if isinstance(node, functions) and node.name == qualname:
                return _check_params_marks(source, node, qualname, params, marks)
        return f"{module}: no function {qualname}"
    cls_name, meth = qualname.split(".")
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for item in node.body:
                if isinstance(item, functions) and item.name == meth:
                    return _check_params_marks(source, item, qualname, params, marks)
            return f"{qualname}: no method {meth}"
    return f"{module}: no class {cls_name}"


def _all_sites():
    sys.path.insert(0, REPO)
    from vllm._shm_embeds.sites import SITES

    return SITES


def fetch(version: str, sites=None) -> str | None:
    """The vLLM package dir of the ``vllm==version`` wheel, site files only.

    Downloaded once (``pip download``) into ``.cache/vllm-<version>/``; later
    calls return the cached tree. None if the wheel cannot be downloaded.
    """
    sites = sites if sites is not None else _all_sites()
    root = os.path.join(CACHE, f"vllm-{version}")
    tree = os.path.join(root, "vllm")
    if os.path.exists(os.path.join(root, "complete")):
        return tree
    with tempfile.TemporaryDirectory() as tmp:
        dl = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                             f"vllm=={version}", "-d", tmp],
                            capture_output=True, text=True, timeout=1800)
        wheels = [f for f in os.listdir(tmp) if f.startswith(f"vllm-{version}-")]
        if dl.returncode != 0 or not wheels:
            return None
        wanted = {f"vllm/{rel}" for s in sites
                  for m in (s.module, *s.alt_modules, *([s.patch_in] if s.patch_in else []))
                  for rel in site_files(m)}
        shutil.rmtree(root, ignore_errors=True)
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
            for name in wanted & set(z.namelist()):
                z.extract(name, root)
    open(os.path.join(root, "complete"), "w").close()
    return tree


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("vllm_dir", nargs="?", help="path of a vLLM package directory (…/vllm)")
    p.add_argument("--fetch", metavar="VERSION", help="check the vllm==VERSION wheel")
    args = p.parse_args()
    sites = _all_sites()
    vllm_dir = fetch(args.fetch, sites) if args.fetch else args.vllm_dir
    if vllm_dir is None:
        p.error("give a vLLM directory, or --fetch VERSION (download failed?)")
    bad = 0
    for s in sites:
        problem = check_site(vllm_dir, s)
        print(f"{'FAIL' if problem else 'ok  '} {s.key:24} {s.module}.{s.qualname}"
              + (f": {problem}" if problem else ""))
        bad += problem is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
