"""Pages are login-required and scoped to cluster members: owner and teammate see, the outsider gets a 404."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from clusterdx import blocks, wire
from dashboard.diagnosis.models import Finding
from dashboard.telemetry.models import Run
from dashboard.web import context
from tests.server.conftest import World, make_batch, off_site_assets, post

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
        assert off_site_assets(page.content.decode()) == []
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
    pages; an upgraded plotly is another URL. scripts/bootstrap.sh installs two of plotly's own bundles: the pages
    that draw only lines and bars load the basic one (scatter, bar), the run page the cartesian one (heatmaps too),
    neither with WebGL traces (data-gl="0"); the link matrix the full one. The app's own files keep a short max-age."""
    import plotly

    post(client, make_batch(), world.token)
    client.force_login(world.owner)
    bundles = {}
    for key, folder, name in (("basic", django_settings.PLOTLY_BASIC_DIR, "plotly-basic"),
                              ("cartesian", django_settings.PLOTLY_CARTESIAN_DIR, "plotly-cartesian")):
        package = folder / "package.json"
        assert package.is_file(), f"scripts/bootstrap.sh installs plotly's {key} bundle (npm ci in dashboard/web/npm)"
        version = json.loads(package.read_text())["version"]
        bundles[key] = f"/static/vendor/{name}/{name}.min.js?v={version}"
    full = f"/static/vendor/plotly/plotly.min.js?v={plotly.__version__}"
    run_id = Run.objects.get().id
    node = f"/clusters/{world.cluster.name}/nodes/node-000/"
    finding = Finding.objects.create(cluster=world.cluster, kind="straggler", subject_type="rank", subject="r/rank1",
                                     severity="warning", title="t", action="a", evidence={}, confidence=0.9,
                                     opened_at=timezone.now(), updated_at=timezone.now(),
                                     last_seen_at=timezone.now())
    pages = {f"/clusters/{world.cluster.name}/": "basic", node: "basic", f"{node}gpus/0/": "basic",
             f"/findings/{finding.id}/": "basic", f"/runs/{run_id}/ranks/0/": "basic", f"/runs/{run_id}/": "cartesian"}
    for url, key in pages.items():
        page = client.get(url).content
        other = bundles["cartesian" if key == "basic" else "basic"]
        assert f'{bundles[key]}" data-gl="0"'.encode() in page, url
        assert full.encode() not in page and other.encode() not in page, url
    assert full.encode() in client.get(f"/clusters/{world.cluster.name}/links/").content
    for asset in (*bundles.values(), full):
        r = client.get(asset)
        assert r.status_code == 200 and "immutable" in r["Cache-Control"], asset
    sizes = {key: len(b"".join(client.get(url).streaming_content)) for key, url in bundles.items()}
    assert 1_000_000 < sizes["basic"] < sizes["cartesian"], sizes
    for url in bundles.values():
        assert b"scattergl" not in b"".join(client.get(url).streaming_content)[:3000], "not the full bundle"
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


def test_without_the_npm_bundles_every_page_loads_the_full_one(client: Any, world: World, tmp_path: Path,
                                                               settings: Any) -> None:
    import plotly

    post(client, make_batch(), world.token)
    client.force_login(world.owner)
    node = f"/clusters/{world.cluster.name}/nodes/node-000/"
    cartesian = json.loads((settings.PLOTLY_CARTESIAN_DIR / "package.json").read_text())["version"]
    try:
        settings.PLOTLY_BASIC_DIR = tmp_path / "absent"  # the basic bundle alone missing: the cartesian one
        context._chart_js.cache_clear(), context._basic_js.cache_clear()
        page = client.get(node).content
        assert f'plotly-cartesian.min.js?v={cartesian}" data-gl="0"'.encode() in page
        settings.PLOTLY_CARTESIAN_DIR = tmp_path / "absent"
        context._chart_js.cache_clear(), context._basic_js.cache_clear()
        page = client.get(node).content
        run = client.get(f"/runs/{Run.objects.get().id}/").content
    finally:
        context._chart_js.cache_clear(), context._basic_js.cache_clear()
    for html in (page, run):
        assert f'href="/static/vendor/plotly/plotly.min.js?v={plotly.__version__}" data-gl="1"'.encode() in html


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
    # Version 2 (clusterdx.blocks): the same batch as blocks fits BatchV2, and not Batch; a block's unknown column
    # or a list of the wrong kind is refused by both.
    v2 = json.loads(json.dumps(blocks.encode_batch(batch)))
    jsonschema.validate(v2, {**schemas["BatchV2"], **resolver_doc})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(v2, {**schemas["Batch"], **resolver_doc})
    for spoil in (lambda b: b["gpus"]["num_cols"].append("nope"), lambda b: b["steps"]["cols"].update(run=[7, 8])):
        worse = json.loads(json.dumps(v2))
        spoil(worse)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(worse, {**schemas["BatchV2"], **resolver_doc})
