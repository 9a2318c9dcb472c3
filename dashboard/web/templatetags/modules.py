"""``{% module_script "web/node.js" %}``: a page's ES module with a ``<link rel="modulepreload">`` for every module it
imports, directly or not.

The browser learns a module's imports only once it has fetched and parsed that module, so a page's script and its
``lib/`` imports loaded one round after the other: on a busy server the node page started its first API request
~300 ms after its own script had arrived. Preloading the whole import graph, read from the files themselves (never
a list kept by hand), fetches them all at once.
"""

from __future__ import annotations

import posixpath
import re
from functools import lru_cache
from pathlib import Path

from django import template
from django.conf import settings
from django.contrib.staticfiles import finders
from django.templatetags.static import static
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

register = template.Library()

# Static imports only (`import {a} from "./x.js"`, `import "./x.js"`, `export {a} from "./x.js"`): a dynamic import()
# is loaded on demand by design and is not preloaded.
_IMPORT = re.compile(r"""^\s*(?:import|export)\b[^"';]*?\bfrom\s*["']([^"']+)["']|^\s*import\s*["']([^"']+)["']""",
                     re.MULTILINE)


def imports_of(source: str) -> list[str]:
    """The module specifiers a module's source imports statically, in order."""
    return [a or b for a, b in _IMPORT.findall(source)]


def _read(path: str) -> str:
    found = finders.find(path)
    if not found:
        raise template.TemplateSyntaxError(f"module_script: no static file {path!r}")
    return Path(found if isinstance(found, str) else found[0]).read_text(encoding="utf-8")


def import_graph(entry: str) -> list[str]:
    """Every static path ``entry`` imports, transitively (relative specifiers only; each once, depth first)."""
    seen: list[str] = []
    stack = [entry]
    while stack:
        path = stack.pop()
        source = _read(path)
        for spec in imports_of(source):
            if not spec.startswith(("./", "../")):
                continue  # a bare or absolute specifier is not one of our static files
            dep = posixpath.normpath(posixpath.join(posixpath.dirname(path), spec))
            if dep not in seen and dep != entry:
                seen.append(dep)
                stack.append(dep)
    return seen


@lru_cache(maxsize=64)
def _cached_graph(entry: str) -> tuple[str, ...]:
    return tuple(import_graph(entry))


@register.simple_tag
def module_script(entry: str) -> SafeString:
    # In DEBUG an edited module's imports are read again on each page; in production the files never change.
    graph = import_graph(entry) if settings.DEBUG else _cached_graph(entry)
    preloads = format_html_join("", '<link rel="modulepreload" href="{}">\n', ((static(p),) for p in graph))
    return format_html('{}<script type="module" src="{}"></script>', preloads, static(entry))
