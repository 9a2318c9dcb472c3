"""Pages are login-required and scoped to cluster members: owner and teammate see, the outsider gets a 404."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from django.conf import settings as django_settings

from clusterdx import wire
from dashboard.telemetry.models import Run
from dashboard.web import context
from tests.server.conftest import World, make_batch, post

pytestmark = pytest.mark.django_db


def test_pages_require_a_login(client: Any, world: World) -> None:
    post(client, make_batch(), world.token)
    run = Run.objects.get()
    for url in ("/", f"/clusters/{world.cluster.name}/", f"/runs/{run.id}/"):
        r = client.get(url)
        assert r.status_code == 302 and r["Location"].startswith("/login/"), url


def test_members_see_the_cluster_and_run_pages(client: Any, world: World) -> None:
    post(client, make_batch(), world.token)
    run = Run.objects.get()
    for user in (world.owner, world.teammate):
        client.force_login(user)
        home = client.get("/")
        assert home.status_code == 200 and b"prod-a" in home.content and b"prod-b" not in home.content
        page = client.get(f"/runs/{run.id}/")
        assert page.status_code == 200
        assert b"/static/vendor/plotly" in page.content, "plotly.js is served locally, never a CDN"
        assert b"cdn" not in page.content.lower()
        assert client.get(f"/clusters/{world.cluster.name}/").status_code == 200


def test_an_outsider_gets_404_not_403(client: Any, world: World) -> None:
    post(client, make_batch(), world.token)
    run = Run.objects.get()
    client.force_login(world.outsider)
    assert client.get(f"/runs/{run.id}/").status_code == 404
    assert client.get(f"/clusters/{world.cluster.name}/").status_code == 404
    assert b"prod-a" not in client.get("/").content


def test_plotly_is_served_from_the_installed_package(client: Any, world: World) -> None:
    r = client.get("/static/vendor/plotly/plotly.min.js")
    assert r.status_code == 200
    body = b"".join(r.streaming_content) if r.streaming else r.content
    assert len(body) > 1_000_000 and b"plotly" in body[:2000].lower()


def test_pages_ask_for_plotly_by_version_and_keep_it_cached(client: Any, world: World) -> None:
    """Plotly under a URL naming its version, served as immutable: a browser keeps it (and its compiled code) across
    pages; an upgraded plotly is another URL. The pages whose first paint is a chart load the cartesian bundle that
    scripts/bootstrap.sh installs (a third of the full one's evaluation, no WebGL traces: data-gl="0"); the others
    the full one. The app's own files keep a short max-age (no version in their URLs)."""
    import plotly

    post(client, make_batch(), world.token)
    client.force_login(world.owner)
    package = django_settings.PLOTLY_CARTESIAN_DIR / "package.json"
    assert package.is_file(), "scripts/bootstrap.sh installs plotly's cartesian bundle (npm ci in dashboard/web/npm)"
    version = json.loads(package.read_text())["version"]
    cartesian = f"/static/vendor/plotly-cartesian/plotly-cartesian.min.js?v={version}"
    full = f"/static/vendor/plotly/plotly.min.js?v={plotly.__version__}"
    run_id = Run.objects.get().id
    for url in (f"/clusters/{world.cluster.name}/", f"/runs/{run_id}/", f"/clusters/{world.cluster.name}/nodes/node-000/"):
        page = client.get(url).content
        assert f'href="{cartesian}" data-gl="0"'.encode() in page and full.encode() not in page, url
    assert full.encode() in client.get(f"/clusters/{world.cluster.name}/links/").content
    for asset in (cartesian, full):
        r = client.get(asset)
        assert r.status_code == 200 and "immutable" in r["Cache-Control"], asset
    body = b"".join(client.get(cartesian).streaming_content)
    assert len(body) > 1_000_000 and b"scattergl" not in body[:3000], "the cartesian bundle, not the full one"
    assert "immutable" not in client.get("/static/web/node.js")["Cache-Control"]


def test_pages_preload_every_module_their_script_imports(client: Any, world: World) -> None:
    """Each page names its whole ES-module graph up front (<link rel="modulepreload">), read from the files' own
    import lines: the browser fetches node.js and its lib/ imports at once instead of one round after the other."""
    import re

    from dashboard.web.templatetags.modules import imports_of

    static = Path(__file__).resolve().parents[2] / "dashboard" / "web" / "static"

    def graph(path: str) -> set[str]:  # an independent walk of the same files
        out: set[str] = set()
        for spec in imports_of((static / path).read_text()):
            dep = str((static / path).parent.joinpath(spec).resolve().relative_to(static))
            if dep not in out:
                out |= {dep} | graph(dep)
        return out

    assert imports_of('import {a, b} from "./lib/x.js";\nexport {c} from \'../y.js\';\nimport "./z.js";\n'
                      'const m = import("./lazy.js");') == ["./lib/x.js", "../y.js", "./z.js"]
    post(client, make_batch(), world.token)
    client.force_login(world.owner)
    run_id = Run.objects.get().id
    pages = {f"/clusters/{world.cluster.name}/": "web/overview.js", f"/runs/{run_id}/": "web/run.js",
             f"/clusters/{world.cluster.name}/nodes/node-000/": "web/node.js",
             f"/clusters/{world.cluster.name}/links/": "web/links.js"}
    for url, entry in pages.items():
        html = client.get(url).content.decode()
        assert f'<script type="module" src="/static/{entry}"></script>' in html, url
        preloaded = set(re.findall(r'<link rel="modulepreload" href="/static/([^"]+)">', html))
        assert preloaded == graph(entry) and "web/lib/fmt.js" in preloaded, (url, preloaded ^ graph(entry))
        for path in preloaded:
            assert client.get(f"/static/{path}").status_code == 200, path
    assert set(re.findall(r"web/[a-z_/]+\.js", html)) >= {"web/lib/chart.js", "web/lib/poll.js", "web/lib/range.js"}


def test_without_the_cartesian_bundle_every_page_loads_the_full_one(client: Any, world: World, tmp_path: Path,
                                                                   settings: Any) -> None:
    import plotly

    post(client, make_batch(), world.token)
    client.force_login(world.owner)
    settings.PLOTLY_CARTESIAN_DIR = tmp_path / "absent"
    context._chart_js.cache_clear()
    try:
        page = client.get(f"/clusters/{world.cluster.name}/nodes/node-000/").content
    finally:
        context._chart_js.cache_clear()
    assert f'href="/static/vendor/plotly/plotly.min.js?v={plotly.__version__}" data-gl="1"'.encode() in page


def test_the_openapi_document_describes_the_wire_format(client: Any) -> None:
    r = client.get("/api/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    ingest = doc["paths"]["/api/v1/ingest"]["post"]
    assert {"200", "400", "401", "403", "405", "413", "415", "503"} <= set(ingest["responses"])
    schemas = doc["components"]["schemas"]
    # The published schema accepts what the validator accepts and refuses what it refuses.
    resolver_doc = {"components": {"schemas": schemas}}
    batch = make_batch(cluster="prod-a")
    assert wire.validate_batch(batch)
    jsonschema.validate(batch, {**schemas["Batch"], **resolver_doc})
    bad = make_batch()
    bad["gpus"][0]["util_gpu_pct"] = 140
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, {**schemas["Batch"], **resolver_doc})
    with pytest.raises(wire.WireError):
        wire.validate_batch(bad)
