"""``clusterdx`` subcommands that drive the server. Django is set up inside ``main`` only, never at import."""

from __future__ import annotations

import os


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()


def migrate(verbose: bool = True) -> None:
    from django.core.management import call_command

    if verbose:
        print("==> applying database migrations", flush=True)
    call_command("migrate", interactive=False, verbosity=0)
