"""One module per page: its view(s), the JSON API the page reads (the same one scripts use), and that API's OpenAPI
path items (``OPENAPI``), gathered by :mod:`dashboard.web.apps` into ``/api/openapi.json``."""

PAGES = ["overview", "node", "finding", "links", "run", "settings", "attention"]
